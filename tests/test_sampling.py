"""Sampled traces, exact budget (docs/span-model.md#sampling).

Live: one reference server (parent-based, so each request's head decision is the load generator's)
and `phaselens bench` (the real OTel SDK exporters) send the same seeded workload twice: once fully
traced (always_on) into one database, once at parentbased_traceidratio 0.05 through an OTLP tee to
both our collector and Rotel, each into a database of its own in the session's embedded ClickHouse.
A few requests the server refuses (400) come with a traceparent: sampled in the first run, not in
the second. The server's tail threshold is out of reach (only failures are tail-kept there); in the
5 % run the load generator's TTFT threshold is the median client TTFT of a run sampled like it just
before (into a database of its own), so its own tail rule splits the run. Every request must be
counted and budgeted from its compact record; the full trees must be the head sample plus every
failed or slow request.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.queries import sketch
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema import schema as S
from phaselens.collectors.rotel_agent import RotelAgent
from phaselens.collectors.service import Collector
from phaselens.instrumentation import names
from tests.analysis_fixtures import client, new_database
from tests.collector_fixtures import otel_env
from tests.otlp_tee import OtlpTee

# 1 % of 100 is one tree: with Binomial(100, 0.05) head trees, P(none) = 0.95^100 = 0.6 % and
# P(more than 25) < 1e-9; the seeded trace ids make the count the same every run
REQUESTS = 100
# requests the server answers 400 (max_tokens < 1): failures kept by the tail rule, refused before the
# engine (no GenAI operation: not a budget request)
REFUSED = 3
RATIO = 0.05
__all__ = ["client"]
FULL = "parentbased_always_on"
SAMPLED = "parentbased_traceidratio"
UNREACHED = "ttft:3600000,tpot:3600000"  # a tail threshold (ms) no request reaches on any machine
TRACE_ID_SEED = 5
# `bench` with the global `random` seeded: the SDK's RandomIdGenerator draws from it
SEEDED_CLI = f"import random, sys; random.seed({TRACE_ID_SEED}); from phaselens.cli import main; sys.exit(main())"
ROWS_WAIT_S = 120.0


def _env(endpoint: str, service: str, sampler: str, tail: str) -> dict[str, str]:
    return otel_env(endpoint, service) | {
        names.ENV_TRACES_SAMPLER: sampler,
        names.ENV_TRACES_SAMPLER_ARG: str(RATIO),
        names.ENV_TAIL_SLO: tail,
    }


def _bench(url: str, endpoint: str, sampler: str, tail: str, head: bool) -> None:
    """The seeded workload, then the refused requests (traceparent sampled iff `head`)."""
    bench = subprocess.run(
        [sys.executable, "-c", SEEDED_CLI, "bench", "--url", url, "--model", "tiny", "--concurrency", "4",
         "--requests", str(REQUESTS), "--input-len", "16", "--output-len", "4", "--ignore-eos", "--seed", "11",
         "--quiet"],
        check=False, env=_env(endpoint, "phaselens-loadgen", sampler, tail), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-2000:]
    for _ in range(REFUSED):
        traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if head else '00'}"
        refused = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 0},
            headers={"traceparent": traceparent},
        )
        assert refused.status_code == 400, refused.text


def _await_rows(client, database: str) -> None:
    """Until `database` holds every request's SERVER root and CLIENT span (the server's exports are
    in order, so nothing of the run comes later); bounded."""
    sql = (
        f"SELECT countIf(SpanKind IN {S.SERVER_KINDS}), countIf(SpanKind IN {S.CLIENT_KINDS}) "
        f"FROM {database}.otel_traces"
    )
    deadline = time.monotonic() + ROWS_WAIT_S
    while (rows := tuple(client.query(sql).result_rows[0])) != (REQUESTS + REFUSED, REQUESTS):
        assert time.monotonic() < deadline, (database, rows)
        time.sleep(0.2)


def _median_client_ttft_ms(client, database: str) -> float:
    return _scalar(client, f"SELECT quantileExact(0.5)(client_ttft_ms) FROM {database}.{S.FACTS_VIEW}")


@pytest.fixture(scope="module")
def runs(clickhouse, client, tmp_path_factory):
    """{"full": database, "calibration": database, "ours": database, "rotel": database,
    "client_tail_ms": threshold}: the 100 % run, a 5 % run with no tail rule, the 5 % run through our
    collector and through Rotel, and its client TTFT threshold: the calibration's median. (The 100 %
    run's median was no split: a fully traced run is slower, and 86–94 of the 94 requests judged by it
    came in under it.)"""
    tmp = tmp_path_factory.mktemp("sampling")
    sides = ("full", "calibration", "ours", "rotel")
    databases = {side: new_database(client, f"sampling_{side}") for side in sides}
    full, calibration, ours = (
        Collector(clickhouse.url, database=databases[side], spool_dir=str(tmp / side), flush_interval_s=0.05).start()
        for side in sides[:3]
    )
    rotel = RotelAgent(clickhouse.url, databases["rotel"], str(tmp / "rotel.log")).start_serving()
    tee = OtlpTee([full.grpc_endpoint])
    serve = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "serve", "--port", "0", "--max-num-seqs", "4", "--seed", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(tee.endpoint, "phaselens-server", FULL, UNREACHED),
    )  # fmt: skip
    try:
        line = serve.stdout.readline()
        assert line.startswith("READY server "), (line, serve.poll() and serve.stderr.read())
        url = line.split()[-1]
        _bench(url, tee.endpoint, FULL, UNREACHED, head=True)
        _await_rows(client, databases["full"])
        tee.retarget([calibration.grpc_endpoint])
        _bench(url, tee.endpoint, SAMPLED, UNREACHED, head=False)
        _await_rows(client, databases["calibration"])
        tee.retarget([ours.grpc_endpoint, rotel.grpc_endpoint])
        client_tail_ms = _median_client_ttft_ms(client, databases["calibration"])
        _bench(url, tee.endpoint, SAMPLED, f"ttft:{client_tail_ms!r},tpot:3600000", head=False)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0  # its spans flushed
        tee.close()
        assert (full.stop(), calibration.stop(), ours.stop(), rotel.stop()) == (True, True, True, 0)
    for database in databases.values():
        rollup.seal_now(client, database)
    return databases | {"client_tail_ms": client_tail_ms}


def _scalar(client, sql: str) -> float:
    return client.query(sql).result_rows[0][0]


def _values(client, database: str, expr: str) -> np.ndarray:
    sql = f"SELECT groupArray(toFloat64({expr})) FROM {database}.{S.FACTS_VIEW} WHERE {expr} IS NOT NULL"
    return np.sort(np.asarray(client.query(sql).result_rows[0][0], dtype=float))


def _bracketed(value: float | None, sorted_values: np.ndarray, level: float, alpha: float) -> bool:
    """Within `alpha` × |x| of an order statistic next to rank level·(n − 1) (alpha: the sketch's
    relative error; 0 for an exact quantile, whatever its interpolation)."""
    h = level * (len(sorted_values) - 1)
    lo, hi = sorted_values[math.floor(h)], sorted_values[math.ceil(h)]
    return value is not None and lo - alpha * abs(lo) - 1e-9 <= value <= hi + alpha * abs(hi) + 1e-9


@dataclasses.dataclass(slots=True, frozen=True)
class Request:
    """One request the server saw, as stored."""

    full: str  # phaselens.trace.full of the SERVER root
    client_full: str | None  # of the CLIENT span (None: a refused request, sent without one)
    ingress_spans: int  # llm.ingress spans in its trace: 1 with the full tree
    failed: bool
    server_ttft_ms: float | None
    client_ttft_ms: float | None


def _trees(client, database: str) -> dict[str, Request]:
    """trace id → `Request`, for every request the server saw."""
    sql = f"""
        SELECT r.trace_id, r.full, c.full, ifNull(p.spans, 0), r.failed, f.server_ttft_ms, f.client_ttft_ms
        FROM (SELECT TraceId AS trace_id, SpanAttributes['{names.PL_TRACE_FULL}'] AS full,
                     StatusCode IN {S.ERROR_CODES} AS failed
              FROM {database}.otel_traces WHERE SpanKind IN {S.SERVER_KINDS}) AS r
        LEFT JOIN (SELECT TraceId, SpanAttributes['{names.PL_TRACE_FULL}'] AS full FROM {database}.otel_traces
                   WHERE SpanKind IN {S.CLIENT_KINDS}) AS c ON c.TraceId = r.trace_id
        LEFT JOIN (SELECT TraceId, count() AS spans FROM {database}.otel_traces
                   WHERE SpanName = '{names.SPAN_INGRESS}' GROUP BY TraceId) AS p ON p.TraceId = r.trace_id
        LEFT JOIN {database}.{S.FACTS_VIEW} AS f ON f.trace_id = r.trace_id
        SETTINGS join_use_nulls = 1"""
    return {row[0]: Request(*row[1:]) for row in client.query(sql).result_rows}


def _head(trace_id: str) -> bool:
    """The ratio sampler's decision: the trace id's low 64 bits under RATIO × 2^64."""
    return int(trace_id, 16) & 0xFFFF_FFFF_FFFF_FFFF < TraceIdRatioBased.get_bound_for_rate(RATIO)


def test_every_request_is_counted_and_budgeted_at_5_percent(runs, client):
    sampled = budget(client, database=runs["ours"], since=None)
    full = budget(client, database=runs["full"], since=None)
    for report in (sampled, full):
        assert (report.requests, report.with_server, report.with_client) == (REQUESTS, REQUESTS, REQUESTS)
    # the server-side percentiles are over every request: the exact order statistics of all of them
    for name in ("server_ttft_ms", "server_tpot_ms"):
        values = _values(client, runs["ours"], name)
        assert len(values) == REQUESTS
        stat = sampled.distributions[name]
        for level, got in ((0.5, stat.p50), (0.9, stat.p90)):
            assert _bracketed(got, values, level, 0.0), (name, level, got)
    # the same seeded workload: the same requests, token for token, in both runs
    tokens = "SELECT groupArray((input_tokens, output_tokens)) FROM (SELECT * FROM {}.{} ORDER BY input_tokens, output_tokens)"
    assert sorted(_scalar(client, tokens.format(runs["ours"], S.FACTS_VIEW))) == sorted(
        _scalar(client, tokens.format(runs["full"], S.FACTS_VIEW))
    )


def test_the_residual_is_over_the_requests_with_both_views(runs, client):
    report = budget(client, database=runs["ours"], since=None)
    residual = {c.name: c for c in report.components}["residual_ms"]
    values = _values(client, runs["ours"], "residual_ms")
    assert len(values) == report.with_client == REQUESTS
    assert _bracketed(residual.ms.p50, values, 0.5, 0.0)


def test_the_head_sample_is_the_load_generators_and_the_server_follows_it(runs, client):
    trees, full_run = _trees(client, runs["ours"]), _trees(client, runs["full"])
    assert len(trees) == len(full_run) == REQUESTS + REFUSED  # one SERVER root per request
    sent = {trace_id for trace_id, r in trees.items() if not r.failed}
    # the seeded trace ids: the same in both runs, so the head count below is the same every run
    assert sent == {trace_id for trace_id, r in full_run.items() if not r.failed}
    head = {trace_id for trace_id, r in trees.items() if r.full == names.TRACE_FULL_HEAD}
    assert head == {trace_id for trace_id in sent if _head(trace_id)}  # the server's root sampler says always_on
    assert head == {trace_id for trace_id, r in trees.items() if r.client_full == names.TRACE_FULL_HEAD}
    assert 0.01 * REQUESTS <= len(head) <= 0.25 * REQUESTS, len(head)
    assert {r.full for r in full_run.values()} == {names.TRACE_FULL_HEAD}  # refused ones too: traceparent 01


def test_full_trees_are_the_head_sample_and_every_failed_request(runs, client):
    """The server's tail threshold is out of reach: its tail trees are the failed requests, whose
    traceparent said not sampled."""
    trees = _trees(client, runs["ours"])
    for r in trees.values():
        assert r.ingress_spans == (r.full != names.TRACE_FULL_NONE), r
        if r.failed:
            assert r.full == names.TRACE_FULL_TAIL_ERROR, r
        else:
            assert r.full in (names.TRACE_FULL_HEAD, names.TRACE_FULL_NONE), r
    assert sum(r.failed for r in trees.values()) == REFUSED


def test_the_tail_rule_keeps_exactly_the_requests_over_the_threshold(runs, client):
    """The load generator's own TTFT threshold, the calibration run's median: its CLIENT span keeps
    its events (its tree) iff head-sampled or over it."""
    threshold_ms, margin_ms = runs["client_tail_ms"], 1e-3  # the stored TTFT is the judged one, rounded
    over = under = 0
    for r in _trees(client, runs["ours"]).values():
        if r.failed or r.client_full == names.TRACE_FULL_HEAD:
            continue
        if r.client_ttft_ms > threshold_ms + margin_ms:
            over += 1
            assert r.client_full == names.TRACE_FULL_TAIL_SLO, (r, threshold_ms)
        elif r.client_ttft_ms < threshold_ms - margin_ms:
            under += 1
            assert r.client_full == names.TRACE_FULL_NONE, (r, threshold_ms)
    assert over > 0 and under > 0, (over, under, threshold_ms)  # the threshold split the run


def test_a_compact_record_is_one_span_per_request_per_side(runs, client):
    sql = f"""
        SELECT countIf(ServiceName = 'phaselens-server'), countIf(ServiceName = 'phaselens-loadgen'),
               anyIf(SpanAttributes['{names.PL_TRACE_FULL}'], SpanKind IN {S.SERVER_KINDS}) AS server_full,
               anyIf(SpanAttributes['{names.PL_TRACE_FULL}'], SpanKind IN {S.CLIENT_KINDS}) AS client_full
        FROM {runs["ours"]}.otel_traces GROUP BY TraceId"""
    rows = client.query(sql).result_rows
    server = [spans for spans, _, full, _ in rows if full == names.TRACE_FULL_NONE]
    loadgen = [spans for _, spans, _, full in rows if full == names.TRACE_FULL_NONE]
    assert server and loadgen
    assert set(server) == set(loadgen) == {1}, (server, loadgen)


def test_a_sampled_run_stores_far_fewer_spans(runs, client):
    """The compact records and the head sample (no request reaches the server's tail threshold; the
    client's tail trees add events, not spans): ≤ 30 % of a fully traced run's spans."""
    stored = {
        side: _scalar(client, f"SELECT count() FROM {runs[side]}.otel_traces") for side in ("full", "ours", "rotel")
    }
    assert stored["ours"] == stored["rotel"] <= 0.30 * stored["full"], stored
    # a CLIENT span keeps its events only with its tree
    kept = f"SpanAttributes['{names.PL_TRACE_FULL}'] != '{names.TRACE_FULL_NONE}'"
    sql = f"SELECT countIf(NOT {kept}), countIf(NOT {kept} AND notEmpty(Events.Name)), countIf({kept} AND empty(Events.Name))"
    compact, with_events, kept_without = client.query(
        f"{sql} FROM {runs['ours']}.otel_traces WHERE SpanKind IN {S.CLIENT_KINDS}"
    ).result_rows[0]
    assert compact > 0 and with_events == kept_without == 0


def test_through_rotel_as_through_ours(runs, client):
    ours, theirs = (budget(client, database=runs[side], since=None) for side in ("ours", "rotel"))
    assert theirs.requests == ours.requests == REQUESTS
    mine, rotels = dataclasses.asdict(ours), dataclasses.asdict(theirs)
    assert mine["filters"].pop("database") != rotels["filters"].pop("database")
    assert _same(mine, rotels)
    assert _trees(client, runs["ours"]) == _trees(client, runs["rotel"])


def _same(ours, theirs, path: str = "") -> bool:
    """Same structure and strings; numbers equal up to float summation order."""
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), path
        return all(_same(ours[k], theirs[k], f"{path}.{k}") for k in ours)
    if isinstance(ours, list):
        assert len(ours) == len(theirs), path
        return all(_same(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs, strict=True)))
    if isinstance(ours, float):
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-9), path
        return True
    assert ours == theirs, path
    return True


def test_the_rollups_and_exact_agree_at_5_percent(runs, client):
    approx = budget(client, database=runs["ours"], since=None, exact=False)
    exact = budget(client, database=runs["ours"], since=None)
    counts = ("requests", "with_client", "with_server", "errors", "no_output")
    assert [getattr(approx, c) for c in counts] == [getattr(exact, c) for c in counts]
    for name in ("server_ttft_ms", "client_ttft_ms"):
        values = _values(client, runs["ours"], name)
        for level, got in ((0.5, approx.distributions[name].p50), (0.9, approx.distributions[name].p90)):
            assert _bracketed(got, values, level, sketch.ALPHA), (name, level, got)


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_a_sampler_ratio_that_is_not_a_number_stops_start_up(command):
    args = (
        ["--port", "0"] if command == "serve" else ["--url", "http://127.0.0.1:9", "--model", "tiny", "--requests", "1"]
    )
    env = os.environ | {names.ENV_TRACES_SAMPLER: SAMPLED, names.ENV_TRACES_SAMPLER_ARG: "abc"}
    done = subprocess.run(
        [sys.executable, "-m", "phaselens", command, *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"{names.ENV_TRACES_SAMPLER_ARG}='abc'" in done.stderr and "Traceback" not in done.stderr, done.stderr
