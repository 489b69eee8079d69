"""`phaselens import aiperf`: another harness's records joined to the server requests by X-Request-ID,
on a real stack (embedded ClickHouse, collector, the reference server with the tiny model).

The records are a real AIPerf 0.13.0 run's export (tests/fixtures/aiperf: 2 warm-up + 16 requests
against the reference server), with each request id given a per-test prefix; the test sends the
server one real streamed request per id it wants joined. The live test runs AIPerf itself, when
`./setup.sh --aiperf` made .venv-aiperf (or PHASELENS_AIPERF names an `aiperf`); against the
session's vLLMs, in tests/test_harness_vllm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.harness.harness_formats import read_aiperf
from phaselens.analysis.harness.harness_import import IMPORT_SCOPE, _insert, client_span, lookup
from phaselens.analysis.harness.harness_records import ClientRecord
from phaselens.analysis.queries.sketch import PENDING_TABLE
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema.schema import PARTS_TABLE
from phaselens.commands import budget as budget_command
from phaselens.commands import harness_import
from phaselens.common.quantile import quantile
from phaselens.instrumentation import names as n
from phaselens.stack import Stack
from tests.aiperf_live import aiperf, facts, profile, settled_facts, wait_joinable
from tests.cli_fixtures import run_command

FIXTURE = Path(__file__).parent / "fixtures" / "aiperf"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(str(tmp_path_factory.mktemp("stack"))) as s:
        with s.client() as ch:  # the import recomputes the sealed rollups it touches; the tests read the views
            rollup.stop_refreshes(ch, s.database)
        yield s


def send(url: str, request_id: str | None, max_tokens: int = 4) -> None:
    """One real streamed chat request, with X-Request-ID when given."""
    headers = {"X-Request-ID": request_id} if request_id is not None else {}
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**payload, "stream": True}, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        r.read()


def export_copy(tmp_path: Path, prefix: str) -> tuple[Path, list[dict]]:
    """The fixture with every x_request_id prefixed (so each test owns its ids); its records as dicts."""
    lines = (FIXTURE / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        r["metadata"]["x_request_id"] = f"{prefix}-{r['metadata']['x_request_id']}"
    out = tmp_path / prefix
    out.mkdir()
    (out / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shutil.copy(FIXTURE / "profile_export_aiperf.json", out)
    return out, records


def queries_rows(ch, name: str, database: str) -> list[dict]:
    from phaselens.analysis.budget.latency_budget import query_rows

    return query_rows(ch, name, {"database": database, "since": None})


def imported_rows(stack: Stack, ids: list[str]) -> int:
    sql = (
        f"SELECT count() FROM {stack.database}.otel_traces WHERE ScopeName = {{s:String}} "
        f"AND SpanAttributes['{n.HTTP_REQUEST_HEADER_X_REQUEST_ID}'] IN {{ids:Array(String)}}"
    )
    with stack.client() as ch:
        params = {"s": IMPORT_SCOPE, "ids": [json.dumps([i]) for i in ids]}
        return int(ch.query(sql, parameters=params).result_rows[0][0])


def test_the_server_span_keeps_the_request_id_the_client_sent(stack):
    send(stack.server_url, "hdr-kept-1")
    send(stack.server_url, "x" * 300)  # cut at X_REQUEST_ID_MAX_CHARS
    wait_joinable(stack, ["hdr-kept-1", "x" * n.X_REQUEST_ID_MAX_CHARS])
    sql = (
        f"SELECT SpanAttributes['{n.HTTP_REQUEST_HEADER_X_REQUEST_ID}'] FROM {stack.database}.otel_traces "
        "WHERE SpanKind = 'Server' AND TraceId = {t:String}"
    )
    with stack.client() as ch:
        (match,) = lookup(ch, stack.database, ["hdr-kept-1"])["hdr-kept-1"]
        assert ch.query(sql, parameters={"t": match.trace_id}).result_rows == [('["hdr-kept-1"]',)]
    row = facts(stack, ["hdr-kept-1"])["hdr-kept-1"]
    assert (row["has_server"], row["span_model"], row["client_harness"]) == (True, "phaselens", None)


def test_a_request_without_the_header_has_no_x_request_id(stack):
    with stack.client() as ch:
        before = ch.query(f"SELECT count() FROM {stack.database}.phaselens_request_facts").result_rows[0][0]
    send(stack.server_url, None)
    deadline = time.monotonic() + 60
    with stack.client() as ch:
        while True:
            rows = ch.query(
                f"SELECT x_request_id FROM {stack.database}.phaselens_request_facts ORDER BY start_time"
            ).result_rows
            if len(rows) > before:
                break
            assert time.monotonic() < deadline
            time.sleep(0.3)
    assert rows[-1] == (None,)


def test_import_joins_each_record_once_and_reports_the_unmatched(stack, tmp_path, capsys):
    folder, raw = export_copy(tmp_path, "join")
    sent = [r["metadata"]["x_request_id"] for r in raw[:15]]
    never = [r["metadata"]["x_request_id"] for r in raw[15:]]  # these ids never reach the server
    for request_id in sent:
        send(stack.server_url, request_id)
    wait_joinable(stack, sent)

    assert (
        run_command(harness_import.register, "import", "aiperf", str(folder), "--clickhouse", stack.clickhouse_url) == 0
    )
    out, err = capsys.readouterr()
    assert "aiperf 0.13.0: 18 records" in out and "imported 15 client spans, 0 already stored" in out
    assert f"warning: 3 records with no server request for their X-Request-ID: {', '.join(never)}" in err

    run = read_aiperf(folder)
    rows = facts(stack, sent + never)
    assert sorted(rows) == sorted(sent)  # the unmatched made no row
    for record in run.records[:15]:
        row = rows[record.request_id]
        # the harness's own figures, exactly as it computed them
        assert (row["client_harness"], row["client_harness_version"]) == ("aiperf", "0.13.0")
        assert row["client_ttft_ms"] == record.ttft_ms and row["client_e2e_ms"] == record.e2e_ms
        assert row["client_ttfo_ms"] == record.ttfo_ms and row["client_tpot_ms"] == record.tpot_ms
        assert row["client_itl_p99_ms"] == pytest.approx(quantile(sorted(record.itl_ms), 0.99), rel=1e-12)
    assert imported_rows(stack, sent) == 15
    with stack.client() as ch:  # the rollups' pending copy holds the imported views too
        traces = [m[0].trace_id for m in lookup(ch, stack.database, sent).values()]
        sql = (
            "SELECT countIf(t_client_harness IS NOT NULL) FROM {db:Identifier}.{t:Identifier} "
            "WHERE TraceId IN {ids:Array(String)}"
        )
        for table in (PARTS_TABLE, PENDING_TABLE):
            params = {"db": stack.database, "t": table, "ids": traces}
            assert ch.query(sql, parameters=params).result_rows == [(15,)]
    with stack.client() as ch:  # the server AIPerf called: what diagnose suggests a second run against
        assert queries_rows(ch, "diagnosis_target", stack.database) == [
            {"server_address": "127.0.0.1", "server_port": "32789"}
        ]

    # the same file again: every span is already stored, nothing is added
    assert (
        run_command(harness_import.register, "import", "aiperf", str(folder), "--clickhouse", stack.clickhouse_url) == 0
    )
    assert "imported 0 client spans, 15 already stored" in capsys.readouterr().out
    assert imported_rows(stack, sent) == 15


def test_an_id_sent_twice_is_ambiguous_and_not_joined_by_guess(stack, tmp_path, capsys):
    folder, raw = export_copy(tmp_path, "twice")
    path = folder / "profile_export.jsonl"
    path.write_text(path.read_text().splitlines()[0] + "\n")
    request_id = raw[0]["metadata"]["x_request_id"]
    send(stack.server_url, request_id)
    send(stack.server_url, request_id)  # a harness that reused its id
    deadline = time.monotonic() + 60
    with stack.client() as ch:
        while len(lookup(ch, stack.database, [request_id]).get(request_id, [])) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.3)
    assert (
        run_command(harness_import.register, "import", "aiperf", str(folder), "--clickhouse", stack.clickhouse_url) == 0
    )
    out, err = capsys.readouterr()
    assert "imported 0 client spans" in out
    assert f"warning: 1 records with several server requests for their X-Request-ID: {request_id}" in err
    assert imported_rows(stack, [request_id]) == 0


def test_a_repeated_insert_is_dropped_by_its_deduplication_token(stack, tmp_path):
    """Below the skip of stored spans: the insert itself, repeated (a crash after it, before the
    report), adds no row, as the collector's spool replay adds none."""
    from opentelemetry.sdk.resources import Resource

    from phaselens.collectors.clickhouse_sink import ClickHouseSink

    folder, _ = export_copy(tmp_path, "dedup")
    run = read_aiperf(folder)
    ids = [r.request_id for r in run.records[:4]]
    for request_id in ids:
        send(stack.server_url, request_id)
    wait_joinable(stack, ids)
    with stack.client() as ch:
        matches = lookup(ch, stack.database, ids)
    resource = Resource.create({"service.name": run.harness})
    spans = [client_span(run, r, matches[r.request_id][0], resource) for r in run.records[:4]]
    sink = ClickHouseSink(stack.clickhouse_url, stack.database)
    try:
        _insert(sink, spans)
        _insert(sink, spans)
    finally:
        sink.close()
    assert imported_rows(stack, ids) == 4


def test_records_join_vllm_native_spans_through_vllms_request_id(stack, tmp_path, capsys):
    """vLLM's own `llm_request` span carries no header, only its request id built on X-Request-Id:
    `chatcmpl-{id}` (chat), `cmpl-{id}-{prompt index}` (completions). Spans built as vLLM 0.32 builds
    them (tests/native_spans.py's provider: the real SDK, OTLP/gRPC to the stack's collector)."""
    from opentelemetry.trace import SpanKind

    from tests.native_spans import provider

    folder, raw = export_copy(tmp_path, "vllm")
    ids = [r["metadata"]["x_request_id"] for r in raw[:2]]
    vllm = provider(stack.otlp_grpc_endpoint, "vllm-native-stand-in")
    t0 = time.time_ns()
    for vllm_id in (f"chatcmpl-{ids[0]}", f"cmpl-{ids[1]}-0"):
        keys = {n.LATENCY_TIME_TO_FIRST_TOKEN: 0.004, n.LATENCY_E2E: 0.02, n.GEN_AI_REQUEST_ID: vllm_id}
        span = vllm.get_tracer("vllm").start_span(n.SPAN_VLLM_REQUEST, kind=SpanKind.SERVER, start_time=t0)
        span.set_attributes(keys)
        span.end(end_time=t0 + 20_000_000)
    vllm.shutdown()
    wait_joinable(stack, ids)
    path = folder / "profile_export.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:2]))

    assert (
        run_command(harness_import.register, "import", "aiperf", str(folder), "--clickhouse", stack.clickhouse_url) == 0
    )
    assert "imported 2 client spans" in capsys.readouterr().out
    rows = facts(stack, ids)
    assert [rows[i]["span_model"] for i in ids] == ["vllm-native", "vllm-native"]
    assert [rows[i]["residual_ms"] for i in ids] == pytest.approx(
        [r.ttft_ms - 4.0 for r in read_aiperf(folder).records]
    )


def test_a_truncated_export_names_the_bad_line_and_imports_the_good_ones(stack, tmp_path, capsys):
    folder, raw = export_copy(tmp_path, "cut")
    path = folder / "profile_export.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # AIPerf killed mid-write
    good = [r["metadata"]["x_request_id"] for r in raw[:-1]]
    for request_id in good:
        send(stack.server_url, request_id)
    wait_joinable(stack, good)

    assert (
        run_command(harness_import.register, "import", "aiperf", str(folder), "--clickhouse", stack.clickhouse_url) == 1
    )
    out, err = capsys.readouterr()
    assert "aiperf 0.13.0: 17 records" in out and "imported 17 client spans" in out
    assert f"error: {path}:18: not an AIPerf record (" in err
    assert imported_rows(stack, good) == 17


def test_an_export_that_is_not_there_is_a_one_line_error(tmp_path, capsys):
    assert (
        run_command(harness_import.register, "import", "aiperf", str(tmp_path), "--clickhouse", "http://127.0.0.1:1")
        == 1
    )
    assert capsys.readouterr().err.startswith(f"error: no AIPerf export at {tmp_path}")


def test_aiperf_records_read_as_aiperf_wrote_them():
    """Units and keys of a real profile_export.jsonl: ms stay ms, tokens are ints, gaps in order."""
    run = read_aiperf(FIXTURE)
    first = json.loads((FIXTURE / "profile_export.jsonl").read_text().splitlines()[0])
    m = first["metrics"]
    assert (run.harness, run.version, run.operation, run.model) == ("aiperf", "0.13.0", n.OP_CHAT, "tiny")
    assert run.server_url == "http://127.0.0.1:32789"  # the reference server that run called
    assert len(run.records) == 18 and run.bad_lines == () and run.without_id == 0
    assert run.records[0] == ClientRecord(
        request_id=first["metadata"]["x_request_id"],
        start_wall_ts=first["metadata"]["request_start_ns"],
        e2e_ms=m["request_latency"]["value"],
        ttft_ms=m["time_to_first_token"]["value"],
        ttfo_ms=m["time_to_first_output_token"]["value"],
        tpot_ms=m["inter_token_latency"]["value"],
        itl_ms=tuple(m["inter_chunk_latency"]["value"]),
        input_tokens=m["input_sequence_length"]["value"],
        output_tokens=m["output_sequence_length"]["value"],
    )


@pytest.mark.skipif(aiperf() is None, reason="no AIPerf: ./setup.sh --aiperf makes .venv-aiperf (1.2 GB)")
def test_live_aiperf_run_gives_the_full_budget(tmp_path, capsys):
    """aiperf profile → phaselens import aiperf → the budget, against the reference server: every
    request joined, every residual ≥ 0 and loopback-sized."""
    from phaselens.integrations.vllm.tiny_model import save_tiny_llama

    requests = 12
    tokenizer = save_tiny_llama(tmp_path / "tokenizer")  # byte-level, offline: AIPerf counts tokens with it
    with Stack(str(tmp_path / "stack")) as s:
        send(s.server_url, None)  # the first forward pass builds the model's kernels: not AIPerf's to wait for
        artifacts = tmp_path / "artifacts"
        ids = profile(s, tokenizer, artifacts, requests)

        assert (
            run_command(harness_import.register, "import", "aiperf", str(artifacts), "--clickhouse", s.clickhouse_url)
            == 0
        )
        assert f"imported {requests} client spans" in capsys.readouterr().out
        rows = settled_facts(s, ids)
        residuals = [rows[i]["residual_ms"] for i in ids]
        wrong = {
            i: (r["residual_ms"], r["client_ttft_ms"])
            for i, r in rows.items()
            if r["residual_ms"] is None or r["residual_ms"] < 0
        }
        assert not wrong, wrong  # (residual, client TTFT) of each request without a residual ≥ 0
        assert statistics.median(residuals) < 100, residuals  # loopback + AIPerf's own client
        with s.client() as ch:
            report = budget(ch, database=s.database, since=None)
        assert report.client_harnesses == ["aiperf 0.13.0"] and report.with_client == requests
        assert report.distributions["residual_ms"].p50 == pytest.approx(statistics.median(residuals))
        # plain `phaselens budget` (the rollups) counts the imported views too, each request once
        want = f"({requests + 1} requests, {requests} with a client view,"
        for _ in range(3):  # a sealing pass between the import's live refresh and the read: up to 10 s late
            assert run_command(budget_command.register, "budget", "--clickhouse", s.clickhouse_url) == 0
            out = capsys.readouterr().out
            if want in out:
                break
            with s.client() as ch:
                rollup.refresh_now(ch, s.database)
        assert want in out and "client views measured by: aiperf 0.13.0\n" in out, out


def test_on_a_cluster_each_client_span_lands_on_its_server_requests_shard(tmp_path):
    """The per-request parts are shard-local: a client span inserted on the wrong shard would be a
    client-only row beside a server-only one. The import goes through otel_traces_distributed."""
    from opentelemetry.trace import SpanKind

    from phaselens.analysis.harness.harness_import import import_run
    from phaselens.analysis.harness.harness_records import HarnessRun
    from phaselens.collectors.service import Collector
    from phaselens.commands import schema as schema_command
    from phaselens.storage.clickhouse_url import connect
    from phaselens.storage.cluster import EmbeddedCluster
    from tests.native_spans import provider

    ids = [f"cluster-{i}" for i in range(8)]
    db = "imports"
    with EmbeddedCluster(str(tmp_path / "cluster"), shards=2, name="phaselens") as cluster:
        url = cluster.urls[0]
        argv = ["schema", "apply", "--clickhouse", url, "--database", db, "--cluster", "phaselens", "--ddl", "per-node"]
        assert run_command(schema_command.register, *argv) == 0
        with Collector(url, database=db, cluster="phaselens", spool_dir=str(tmp_path / "spool")) as c:
            server = provider(c.grpc_endpoint, "phaselens-server")
            t0 = time.time_ns()
            for request_id in ids:
                span = server.get_tracer("s").start_span("chat tiny", kind=SpanKind.SERVER, start_time=t0)
                span.set_attributes(
                    {
                        n.GEN_AI_OPERATION_NAME: n.OP_CHAT,
                        n.PL_SERVER_TTFT_MS: 5.0,
                        n.PL_SERVER_TTFC_MS: 6.0,
                        n.HTTP_REQUEST_HEADER_X_REQUEST_ID: [request_id],
                    }
                )
                span.end(end_time=t0 + 30_000_000)
            server.shutdown()
        records = tuple(ClientRecord(i, t0 - 1_000_000, e2e_ms=40.0, ttft_ms=10.0) for i in ids)
        run = HarnessRun("aiperf", "0.13.0", n.OP_CHAT, "tiny", records)
        with connect(url) as ch:
            deadline = time.monotonic() + 30
            while len(lookup(ch, db, ids)) < len(ids):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            nodes = [connect(u) for u in cluster.urls]
            for node in nodes:  # every request sealed before the import, on its own shard
                rollup.stop_refreshes(node, db)
                rollup.seal_now(node, db)
            report = import_run(ch, url, run, db)
            assert (report.imported, report.unmatched) == (8, [])
            # each shard recomputed its own sealed minutes: the default budget counts each request once
            assert len(report.rollups) == 2 and sum(r.requests for r in report.rollups) == 8
            for node in nodes:
                rollup.refresh_live(node, db)
                node.close()
            approx = budget(ch, database=db, since=None, exact=False)
            assert (approx.source, approx.requests, approx.with_client) == ("rollup", 8, 8)
            assert approx.client_harnesses == ["aiperf 0.13.0"]
            assert approx.distributions["residual_ms"].mean == pytest.approx(4.0)
            rows = ch.query(f"SELECT has_client, has_server, residual_ms FROM {db}.phaselens_request_facts").result_rows
            assert sorted(rows) == [(True, True, 4.0)] * 8  # joined on the shard: no client-only row
            placed = ch.query(
                f"SELECT count(), countIf(_shard_num != cityHash64(TraceId) % 2 + 1) FROM {db}.otel_traces_distributed "
                "WHERE SpanKind = 'Client'"
            ).result_rows
            assert placed == [(8, 0)]
