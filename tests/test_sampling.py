"""Sampled traces, exact budget (docs/span-model.md#sampling).

Live: the reference server and `phaselens bench` (the real OTel SDK exporters) send the same seeded
workload twice, once fully traced and once at OTEL_TRACES_SAMPLER=parentbased_traceidratio 0.05,
plus a few requests the server refuses (400); the sampled run goes through an OTLP tee to both our
collector and Rotel, each into a database of its own in the session's embedded ClickHouse. Every
request must be counted and budgeted from its compact record; the full trees must be the head sample
plus every failed or slow request.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest

from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.queries import sketch
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema import schema as S
from phaselens.collectors.rotel_agent import RotelAgent
from phaselens.collectors.service import Collector
from phaselens.common.slo import DEFAULT_SLO
from phaselens.instrumentation import names
from tests.analysis_fixtures import client, new_database
from tests.otlp_tee import OtlpTee

REQUESTS = 150
# requests the server answers 400 (max_tokens < 1): failures kept by the tail rule, refused before the
# engine (no GenAI operation: not a budget request)
REFUSED = 3
RATIO = 0.05
__all__ = ["client"]
FULL = "parentbased_always_on"
SAMPLED = "parentbased_traceidratio"


def _env(endpoint: str, service: str, sampler: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != names.ENV_TAIL_SLO}  # the default threshold: the SLO
    return env | {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        names.ENV_TRACES_SAMPLER: sampler,
        names.ENV_TRACES_SAMPLER_ARG: str(RATIO),
    }


def _serve_and_bench(endpoint: str, sampler: str) -> None:
    """The workload against a fresh server exporting to `endpoint`; the server stopped (flushed) after."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "serve", "--port", "0", "--max-num-seqs", "4", "--seed", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(endpoint, "phaselens-server", sampler),
    )  # fmt: skip
    try:
        line = serve.stdout.readline()
        assert line.startswith("READY server "), (line, serve.poll() and serve.stderr.read())
        url = line.split()[-1]
        bench = subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny", "--concurrency", "4",
             "--requests", str(REQUESTS), "--input-len", "16", "--output-len", "6", "--ignore-eos", "--seed", "11",
             "--quiet"],
            check=False, env=_env(endpoint, "phaselens-loadgen", sampler), capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr[-2000:]
        for _ in range(REFUSED):
            refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0})
            assert refused.status_code == 400, refused.text
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0  # its spans flushed


@pytest.fixture(scope="module")
def runs(clickhouse, client, tmp_path_factory):
    """{"full": database, "ours": database, "rotel": database}: the 100 % run, the 5 % run through
    our collector and through Rotel."""
    tmp = tmp_path_factory.mktemp("sampling")
    databases = {side: new_database(client, f"sampling_{side}") for side in ("full", "ours", "rotel")}
    collector = Collector(clickhouse.url, database=databases["full"], spool_dir=str(tmp / "full"),
                          flush_interval_s=0.05).start()  # fmt: skip
    try:
        _serve_and_bench(collector.grpc_endpoint, FULL)
    finally:
        assert collector.stop()
    collector = Collector(clickhouse.url, database=databases["ours"], spool_dir=str(tmp / "ours"),
                          flush_interval_s=0.05).start()  # fmt: skip
    rotel = RotelAgent(clickhouse.url, databases["rotel"], str(tmp / "rotel.log")).start_serving()
    tee = OtlpTee([collector.grpc_endpoint, rotel.grpc_endpoint])
    try:
        _serve_and_bench(tee.endpoint, SAMPLED)
    finally:
        tee.close()
        assert collector.stop() and rotel.stop() == 0
    for database in databases.values():
        rollup.seal_now(client, database)
    return databases


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


def _trees(client, database: str) -> dict[str, tuple[str, int, str, float | None, float | None]]:
    """trace id → (phaselens.trace.full of the SERVER root, its trace's llm.ingress spans, whether the
    root failed, server TTFT ms, server TPOT ms), for every request the server saw."""
    sql = f"""
        SELECT r.trace_id, r.full, ifNull(p.spans, 0), r.failed, f.server_ttft_ms, f.server_tpot_ms
        FROM (SELECT TraceId AS trace_id, SpanAttributes['{names.PL_TRACE_FULL}'] AS full,
                     StatusCode IN {S.ERROR_CODES} AS failed
              FROM {database}.otel_traces WHERE SpanKind IN {S.SERVER_KINDS}) AS r
        LEFT JOIN (SELECT TraceId, count() AS spans FROM {database}.otel_traces
                   WHERE SpanName = '{names.SPAN_INGRESS}' GROUP BY TraceId) AS p ON p.TraceId = r.trace_id
        LEFT JOIN {database}.{S.FACTS_VIEW} AS f ON f.trace_id = r.trace_id"""
    return {row[0]: row[1:] for row in client.query(sql).result_rows}


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


def test_full_trees_are_the_head_sample_and_every_failed_or_slow_request(runs, client):
    trees = _trees(client, runs["ours"])
    assert len(trees) == REQUESTS + REFUSED  # one SERVER root per request
    reasons = [full for full, _, _, _, _ in trees.values()]
    head = reasons.count(names.TRACE_FULL_HEAD)
    assert 0.01 * REQUESTS <= head <= 0.25 * REQUESTS, reasons
    for full, spans, failed, ttft_ms, tpot_ms in trees.values():
        assert spans == (full != names.TRACE_FULL_NONE), (full, spans)
        slow = (ttft_ms or 0) > DEFAULT_SLO.ttft_ms or (tpot_ms or 0) > DEFAULT_SLO.tpot_ms
        if failed:
            assert full in (names.TRACE_FULL_HEAD, names.TRACE_FULL_TAIL_ERROR)
        elif slow:
            assert full in (names.TRACE_FULL_HEAD, names.TRACE_FULL_TAIL_SLO)
        else:
            assert full in (names.TRACE_FULL_HEAD, names.TRACE_FULL_NONE)
    assert sum(failed for _, _, failed, _, _ in trees.values()) == REFUSED
    assert {full for full, *_ in _trees(client, runs["full"]).values()} == {names.TRACE_FULL_HEAD}


def test_a_sampled_run_stores_far_fewer_spans(runs, client):
    """The compact records and the head sample: ≤ 30 % of a fully traced run's spans. The tail's trees
    come on top (how many requests exceed the SLO depends on the machine's load, not on sampling)."""
    tail = f"""TraceId IN (SELECT TraceId FROM {{db}}.otel_traces
        WHERE SpanAttributes['{names.PL_TRACE_FULL}'] IN ('{names.TRACE_FULL_TAIL_ERROR}', '{names.TRACE_FULL_TAIL_SLO}'))"""
    stored = {
        side: _scalar(client, f"SELECT countIf(NOT ({tail.format(db=db)})) FROM {db}.otel_traces")
        for side, db in runs.items()
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
