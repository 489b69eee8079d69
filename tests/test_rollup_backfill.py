"""Imported client views in the default (rollup) budget: `phaselens import` recomputes the sealed
minutes of its requests (analysis/rollup/rollup_backfill.py), or leaves a request not sealed yet to the
sealing pass, which then seals it with its view. Real server spans through OTLP and the collector
into the embedded ClickHouse, the import through the collector's renderer and sink; the sealing
views are stopped and the tests seal (`rollup.seal_now`) where the order matters."""

from __future__ import annotations

import random
import time

import pytest

from phaselens.analysis import queries as Q
from phaselens.analysis.budget.latency_budget import BudgetReport, budget
from phaselens.analysis.harness.harness_import import import_run, lookup
from phaselens.analysis.harness.harness_records import ClientRecord, HarnessRun
from phaselens.analysis.queries import sketch
from phaselens.analysis.queries.id_batches import slices
from phaselens.analysis.rollup import rollup, rollup_backfill, step_rollup
from phaselens.analysis.schema import schema as S
from phaselens.collectors import schema as collector_schema
from phaselens.collectors.service import Collector
from phaselens.commands import rollup as rollup_command
from phaselens.instrumentation import names as n
from tests import spangen
from tests.analysis_fixtures import client, new_database
from tests.cli_fixtures import run_command
from tests.native_spans import provider

__all__ = ["client"]


def _serve(
    clickhouse_url: str, database: str, ids: list[str], seed: int, tmp_path, earlier: tuple[str, ...] = ()
) -> dict[str, float]:
    """One SERVER span per id, with the id as its X-Request-ID (`earlier` ones started 3 minutes
    before the others: another rollup minute); returns each one's TTFC (ms)."""
    from opentelemetry.trace import SpanKind

    rng = random.Random(seed)
    ttfc = {i: rng.uniform(3, 40) for i in ids}
    with Collector(clickhouse_url, database=database, spool_dir=str(tmp_path / f"spool-{seed}")) as c:
        server = provider(c.grpc_endpoint, "phaselens-server")
        t0 = time.time_ns()
        for request_id in ids:
            start = t0 - (180 * 10**9 if request_id in earlier else 0)
            span = server.get_tracer("s").start_span("chat tiny", kind=SpanKind.SERVER, start_time=start)
            span.set_attributes(
                {
                    n.GEN_AI_OPERATION_NAME: n.OP_CHAT,
                    n.PL_SERVER_TTFT_MS: ttfc[request_id] - 1.0,
                    n.PL_SERVER_TTFC_MS: ttfc[request_id],
                    n.HTTP_REQUEST_HEADER_X_REQUEST_ID: [request_id],
                }
            )
            span.end(end_time=start + 80_000_000)
        server.shutdown()
    return ttfc


def _wait_joinable(ch, database: str, ids: list[str]) -> None:
    deadline = time.monotonic() + 30
    while len(lookup(ch, database, ids)) < len(ids):
        assert time.monotonic() < deadline, "server spans did not arrive"
        time.sleep(0.2)


def _run(ttfc: dict[str, float], seed: int) -> HarnessRun:
    """AIPerf-like records: TTFT = the server's TTFC + a residual of 1–9 ms."""
    rng = random.Random(seed)
    t0 = time.time_ns()
    records = tuple(
        ClientRecord(i, t0, e2e_ms=ms + 60.0, ttft_ms=ms + rng.uniform(1, 9), output_tokens=8) for i, ms in ttfc.items()
    )
    return HarnessRun("aiperf", "0.13.0", n.OP_CHAT, "tiny", records)


def _import(ch, url: str, database: str, run: HarnessRun) -> list[rollup_backfill.Backfilled]:
    report = import_run(ch, url, run, database)
    assert not report.unmatched and not report.ambiguous
    rollup.refresh_live(ch, database)  # the views are stopped: what their next refresh would do
    return report.rollups


def _agree(ch, database: str, requests: int, with_client: int) -> BudgetReport:
    """The rollup budget counts each request once and equals the exact one within the sketch's error."""
    approx = budget(ch, database=database, since=None, exact=False)
    exact = budget(ch, database=database, since=None)
    assert approx.source == "rollup"
    counts = ("requests", "with_client", "with_server", "errors", "client_harnesses")
    assert [getattr(approx, c) for c in counts] == [getattr(exact, c) for c in counts]
    assert (exact.requests, exact.with_client) == (requests, with_client)
    for name in ("residual_ms", "client_ttft_ms", "server_ttfc_ms"):
        got, want = approx.distributions[name], exact.distributions[name]
        if want.mean is None:
            assert got.mean is None, name
            continue
        assert got.mean == pytest.approx(want.mean, rel=1e-9), name
        values = sorted(
            v for (v,) in ch.query(f"SELECT {name} FROM {database}.{S.FACTS_VIEW} WHERE {name} IS NOT NULL").result_rows
        )
        for level, value in zip(sketch.LEVELS, (got.p50, got.p90, got.p99), strict=True):
            h = level * (len(values) - 1)
            lo, hi = values[int(h)], values[min(int(h) + 1, len(values) - 1)]
            assert lo * (1 - sketch.ALPHA) - 1e-9 <= value <= hi * (1 + sketch.ALPHA) + 1e-9, (name, level, value)
    return approx


def test_an_import_after_or_before_sealing_counts_once_in_the_rollup_budget(clickhouse, client, tmp_path, capsys):
    database = new_database(client, "backfill")
    sealed_ids = [f"sealed-{i}" for i in range(24)]
    ttfc = _serve(clickhouse.url, database, sealed_ids, 1, tmp_path)
    _wait_joinable(client, database, sealed_ids)
    rollup.seal_now(client, database)
    _agree(client, database, 24, 0)

    # after sealing: the import recomputes the minutes of its requests, each request once
    first = _run({i: ttfc[i] for i in sealed_ids[:16]}, 2)
    (node,) = _import(client, clickhouse.url, database, first)
    assert (node.requests, node.rounds) == (24, 1) and node.minutes >= 1
    report = _agree(client, database, 24, 16)
    assert report.client_harnesses == ["aiperf 0.13.0"]

    # the same file again: the spans are stored, the minutes recomputed to the same rows
    again = import_run(client, clickhouse.url, first, database)
    assert (again.imported, again.already) == (0, 16)
    rollup.refresh_live(client, database)
    assert budget(client, database=database, since=None, exact=False) == report
    rollup.seal_now(client, database)  # the imported parts are no requests of their own
    assert budget(client, database=database, since=None, exact=False) == report

    # before sealing: a request not sealed yet is left to the pass, which seals it with its view
    fresh_ids = [f"fresh-{i}" for i in range(12)]
    fresh = _serve(clickhouse.url, database, fresh_ids, 3, tmp_path)
    _wait_joinable(client, database, fresh_ids)
    (node,) = _import(client, clickhouse.url, database, _run(fresh, 4))
    assert node.requests < 24 + 12 or node.minutes > 1  # the fresh ones are not counted by the recompute
    _agree(client, database, 36, 28)  # the live states hold them, with their views
    rollup.seal_now(client, database)
    sealed = _agree(client, database, 36, 28)
    rollup.seal_now(client, database)
    assert budget(client, database=database, since=None, exact=False) == sealed

    # `phaselens rollup backfill` over the last hour: the same rows again
    argv = ["rollup", "backfill", "--clickhouse", clickhouse.url, "--database", database, "--since", "1h"]
    assert run_command(rollup_command.register, *argv) == 0
    assert capsys.readouterr().out.startswith("node 1: ")
    rollup.refresh_live(client, database)
    _agree(client, database, 36, 28)  # means summed in another order: equal to the last bits only


def _engine(ch, database: str, name: str) -> dict:
    sql, params = Q.render_cli(name, database=database)
    result = ch.query(sql, parameters=params)
    (row,) = result.result_rows
    return dict(zip(result.column_names, row, strict=True))


def test_steps_stored_before_the_step_rollup_existed_are_recomputed_by_the_command(clickhouse, client, capsys):
    """Engine steps stored while the step rollup had no view (an upgrade from before it), then steps
    the view counts: `phaselens rollup backfill` recomputes the minutes that miss steps, after which
    the rollup's counts are the exact ones; a second run finds every minute complete."""
    database = new_database(client, "steps")
    client.command(f"DROP VIEW {database}.{step_rollup.ROLLUP_MV}")
    spangen.emit(spangen.generate(30, seed=41, n_steps=120), clickhouse.url, database, seed=41)
    collector_schema.apply(client, step_rollup.statements(database))  # the upgrade creates the view
    spangen.emit(spangen.generate(30, seed=42, n_steps=80), clickhouse.url, database, seed=42)
    exact = _engine(client, database, "diagnosis_engine")
    assert exact["steps"] == 200 and _engine(client, database, "diagnosis_engine_rollup")["steps"] == 80

    argv = ["rollup", "backfill", "--clickhouse", clickhouse.url, "--database", database, "--since", "1h"]
    assert run_command(rollup_command.register, *argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("node 1: ") and "engine steps: 0 minutes" not in out, out
    approx = _engine(client, database, "diagnosis_engine_rollup")
    same = ("steps", "mixed_steps", "decode_steps", "delayed_decodes", "preemptions", "kv_used_max", "queue_depth_max")
    assert [approx[k] for k in same] == [exact[k] for k in same]
    assert approx["batch_size_mean"] == pytest.approx(exact["batch_size_mean"], rel=1e-12)
    assert run_command(rollup_command.register, *argv) == 0
    assert capsys.readouterr().out.endswith("engine steps: 0 minutes recomputed\n")


def test_rollup_backfill_refuses_a_bad_window(capsys):
    argv = ["rollup", "backfill", "--since", "an hour", "--clickhouse", "http://127.0.0.1:9"]
    assert run_command(rollup_command.register, *argv) == 1
    assert capsys.readouterr().err == "error: a duration looks like 500ms, 30s, 15m, 2h or 7d, not 'an hour'\n"


def test_a_request_a_recompute_counted_is_never_sealed_again(clickhouse, client, tmp_path):
    """The race the claim closes: a request whose parts the recompute read but whose pending copy
    it did not see yet (the copy is made by the same insert, a moment later)."""
    database = new_database(client, "claim")
    first = [f"early-{i}" for i in range(6)]
    _serve(clickhouse.url, database, first, 5, tmp_path)
    _wait_joinable(client, database, first)
    rollup.seal_now(client, database)  # the node's watermark is set
    late = [f"late-{i}" for i in range(6)]
    _serve(clickhouse.url, database, late, 6, tmp_path)
    _wait_joinable(client, database, late)
    traces = [m[0].trace_id for m in lookup(client, database, late).values()]
    pending = f"{database}.{sketch.PENDING_TABLE}"
    params = {"t": traces}
    client.command(f"DELETE FROM {pending} WHERE TraceId IN {{t:Array(String)}}", parameters=params)

    # the minutes of both groups: a minute may turn between them (CI saw 6 of 12 in the late minute)
    early = [m[0].trace_id for m in lookup(client, database, first).values()]
    minutes = rollup_backfill.minutes_of(client, database, early + traces)
    done = rollup_backfill.backfill(client, database, minutes)
    assert done.requests == 12  # the late ones look sealed: no pending copy
    columns = ", ".join(["TraceId", *(p.column for p in S.PARTS)])
    client.command(  # their copies arrive now, as the pending view would have made them
        f"INSERT INTO {pending} ({columns}, inserted, harness_only) SELECT {columns}, now64(3), 0 "
        f"FROM {database}.{S.PARTS_TABLE} WHERE TraceId IN {{t:Array(String)}}",
        parameters=params,
    )
    rollup.seal_now(client, database)
    _agree(client, database, 12, 0)


def test_a_pass_that_commits_during_a_recompute_makes_it_run_again(clickhouse, client, tmp_path, monkeypatch):
    """A sealing pass commits between the recompute's read of the watermark and its delete (here
    forced at that point; live, any pass every 30 s may). The delete removes that pass's rows of the
    recomputed minutes; its row of another minute stays, so the watermark has moved and the
    recompute runs again, now counting that pass's requests of its minutes."""
    database = new_database(client, "again")
    early = [f"early-{i}" for i in range(8)]
    _serve(clickhouse.url, database, early, 7, tmp_path)
    _wait_joinable(client, database, early)
    rollup.seal_now(client, database)
    fresh = [f"fresh-{i}" for i in range(5)]
    _serve(clickhouse.url, database, fresh, 8, tmp_path, earlier=("fresh-0",))
    _wait_joinable(client, database, fresh)  # not sealed yet
    read = rollup_backfill.sealed_requests
    passes: list[int] = []

    def a_pass_commits_meanwhile(*args: object) -> list[str]:
        ids = read(*args)  # type: ignore[arg-type]
        if not passes:
            rollup.seal_now(client, database)  # seals the fresh ones: rows the delete will remove
        passes.append(len(ids))
        return ids

    monkeypatch.setattr(rollup_backfill, "sealed_requests", a_pass_commits_meanwhile)
    traces = [m[0].trace_id for m in lookup(client, database, early).values()]
    minutes = rollup_backfill.minutes_of(client, database, traces)  # fresh-0's minute is not one of them
    done = rollup_backfill.backfill(client, database, minutes)
    in_minutes = client.query(  # early and fresh-1…4, unless a minute began between them
        f"SELECT count() FROM {database}.{S.FACTS_VIEW} WHERE toUInt32(toStartOfMinute(start_time)) "
        "IN {m:Array(UInt32)}",
        parameters={"m": minutes},
    ).result_rows[0][0]
    assert (done.rounds, passes) == (2, [8, in_minutes]) and in_minutes in (8, 12)
    rollup.refresh_live(client, database)
    _agree(client, database, 13, 0)
    rollup.seal_now(client, database)
    _agree(client, database, 13, 0)


def test_long_id_lists_go_in_runs_clickhouse_accepts(client):
    """ClickHouse refuses a bound parameter of 128 KiB or more: 5,000 ids of 36 characters (an AIPerf
    run's X-Request-IDs) are 190 KB as one array."""
    database = new_database(client, "ids")
    ids = [f"{i:08d}-0000-4000-8000-000000000000" for i in range(5000)]
    assert [len(range(5000)[s]) for s in slices(ids)] == [1315, 1315, 1315, 1055]  # 76 bytes an id at most
    assert lookup(client, database, ids) == {}
    assert rollup_backfill.minutes_of(client, database, ids) == []
