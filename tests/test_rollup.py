"""The budget rollups (analysis/rollup/rollup.py) against the exact per-request path: spans with known
durations through the real OTLP exporter and collector into the embedded ClickHouse; the rollup's
figures agree with the exact ones within the error analysis/queries/sketch.py states, a request counts once
however its spans are split over inserts, and the refreshable views fill the rollup on their own."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from phaselens.analysis import queries as Q
from phaselens.analysis.budget import latency_budget as B
from phaselens.analysis.queries import rollups as QR
from phaselens.analysis.queries import sketch
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema import schema as S
from phaselens.collectors import schema as CS
from phaselens.common.slo import SLO
from phaselens.faults.parts import wait_until
from tests import spangen
from tests.analysis_fixtures import client, new_database

SLOS = SLO(ttft_ms=40, tpot_ms=12)
__all__ = ["client"]


def _stopped_database(client) -> str:
    """A database with the schema whose views do not seal on their own: the tests seal."""
    return new_database(client, "rollup")


@pytest.fixture(scope="module")
def sealed(clickhouse, client):
    """400 requests of every kind and 400 engine steps through OTLP and the collector, then sealed."""
    w = spangen.generate(400, seed=21, server_only_every=7, abort_every=9, preempt_every=5, n_steps=400)
    database = _stopped_database(client)
    spangen.emit(w, clickhouse.url, database)
    rollup.seal_now(client, database)
    return w, database


def _values(client, database: str, expr: str) -> np.ndarray:
    """Every request's non-NULL value of `expr` over the facts view, sorted."""
    sql = f"SELECT groupArray(toFloat64({expr})) FROM {database}.{S.FACTS_VIEW}"
    return np.sort(np.asarray(client.query(sql).result_rows[0][0], dtype=float))


def _within_sketch_error(value: float, sorted_values: np.ndarray, level: float) -> bool:
    """DDSketch's bound: within ALPHA × |x| of x, an order statistic next to rank level·(n − 1)."""
    h = level * (len(sorted_values) - 1)
    lo, hi = sorted_values[math.floor(h)], sorted_values[math.ceil(h)]
    return lo - sketch.ALPHA * abs(lo) - 1e-9 <= value <= hi + sketch.ALPHA * abs(hi) + 1e-9


def _near(values: np.ndarray, edge: float) -> int:
    """How many values lie within one log bucket (a factor γ) of `edge`."""
    return int(np.count_nonzero((values > edge / sketch.GAMMA) & (values <= edge * sketch.GAMMA)))


def test_rollup_and_exact_budgets_agree_within_the_stated_error(client, sealed):
    _, database = sealed
    approx = B.budget(client, database=database, since=None, slo=SLOS, exact=False)
    exact = B.budget(client, database=database, since=None, slo=SLOS)
    assert (approx.source, approx.approximation, exact.source) == ("rollup", sketch.NOTE, "exact")
    counts = ("requests", "with_client", "with_server", "errors", "no_output", "span_models")
    assert [getattr(approx, c) for c in counts] == [getattr(exact, c) for c in counts]
    assert exact.requests == 400 and exact.errors > 0 and exact.with_client < exact.with_server
    assert approx.goodput.window_s == pytest.approx(exact.goodput.window_s, rel=1e-12)
    checked = 0
    for name, expr in Q.DISTRIBUTIONS:
        got, want = approx.distributions[name], exact.distributions[name]
        assert got.mean == (None if want.mean is None else pytest.approx(want.mean, rel=1e-9, abs=1e-12)), name
        values = _values(client, database, expr)
        if not len(values) or want.values() == (None, None, None, None):  # none, or unobserved (no stamps)
            assert got.values() == (None, None, None, None), name
            continue
        for level, value in zip(sketch.LEVELS, (got.p50, got.p90, got.p99), strict=True):
            h = level * (len(values) - 1)
            bracket = values[math.floor(h)], values[math.ceil(h)]
            assert _within_sketch_error(value, values, level), (name, level, value, bracket, len(values))
            checked += 1
    assert checked >= 3 * 15
    # goodput: only requests within 2 % of an SLO may land on the other side
    ok = "status = 'ok' AND ttft_ms IS NOT NULL"
    borderline = _near(_values(client, database, f"if({ok}, ttft_ms, NULL)"), SLOS.ttft_ms) + _near(
        _values(client, database, f"if({ok}, tpot_ms, NULL)"), SLOS.tpot_ms
    )
    assert exact.goodput.good_requests > 0
    assert abs(approx.goodput.good_requests - exact.goodput.good_requests) <= max(1, borderline)
    # tail: the same threshold within the sketch's error, the same requests but those near it
    ttft = _values(client, database, "ttft_ms")
    assert _within_sketch_error(approx.tail.threshold_ms, ttft, 0.99)
    near = _near(ttft, exact.tail.threshold_ms) + _near(ttft, approx.tail.threshold_ms)
    assert abs(approx.tail.requests - exact.tail.requests) <= max(1, near)
    assert approx.tail.grew_most == exact.tail.grew_most


def _row(client, name: str, database: str, **filters) -> list[dict]:
    sql, params = Q.render_cli(name, database=database, **filters)
    result = client.query(sql, parameters=params)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


def _step_values(client, sql: str) -> np.ndarray:
    return np.sort(np.asarray(client.query(sql).result_columns[0], dtype=float))


def test_the_steps_rollup_agrees_with_every_step_within_the_stated_error(client, sealed):
    """Counts and sums exact; the baseline (decode-only p50), the mixed p50 and the KV p90 within
    the sketch's error; each mixed step's extra off by at most the baseline's error (plus, for the
    steps within 2 % of the baseline, the bucket's width)."""
    _, database = sealed
    (exact,) = _row(client, "diagnosis_engine", database)
    (approx,) = _row(client, "diagnosis_engine_rollup", database)
    (stalls,) = _row(client, "decode_stalls_rollup", database)
    assert exact["steps"] == 400 and exact["mixed_steps"] > 50
    same = ("steps", "mixed_steps", "decode_steps", "delayed_decodes", "preemptions", "kv_used_max", "queue_depth_max")
    assert [approx[k] for k in same] == [exact[k] for k in same]
    assert approx["batch_size_mean"] == pytest.approx(exact["batch_size_mean"], rel=1e-12)
    steps = f"FROM {database}.{S.STEPS_VIEW} WHERE"
    decode = _step_values(client, f"SELECT duration_ms {steps} prefill_tokens = 0 AND decode_tokens > 0")
    mixed = _step_values(client, f"SELECT duration_ms {steps} prefill_tokens > 0 AND decode_tokens > 0")
    kv = _step_values(client, f"SELECT kv_blocks_used / kv_blocks_total {steps} 1")
    assert _within_sketch_error(approx["decode_step_p50_ms"], decode, 0.5)
    assert _within_sketch_error(approx["mixed_step_p50_ms"], mixed, 0.5)
    assert _within_sketch_error(approx["kv_used_p90"], kv, 0.9)
    base, base_approx = exact["decode_step_p50_ms"], approx["decode_step_p50_ms"]
    error = abs(base_approx - base) + _near(mixed, base) * (sketch.GAMMA - 1) * base
    assert abs(approx["stall_ms"] - exact["stall_ms"]) <= exact["mixed_steps"] * error + 1e-9
    assert approx["stall_share"] == pytest.approx(exact["stall_share"], rel=0.05)
    assert (stalls["baseline_ms"], stalls["request_stall_ms"]) == (base_approx, approx["request_stall_ms"])
    report = B.budget(client, database=database, since=None, exact=False)
    assert report.stalls.mixed_steps == exact["mixed_steps"] and report.stalls.stall_ms == stalls["stall_ms"]


def test_the_verdict_and_the_slowest_requests_from_the_rollups(client, sealed):
    """The dashboard's verdict ranks the same causes with the same roles as the exact one, and its
    slowest requests are the exact ones, in order, with the same figures."""
    _, database = sealed
    slo = {"ttft_slo_ms": 40, "tpot_slo_ms": 12}
    exact = _row(client, "diagnosis_causes", database, **slo)
    approx = _row(client, "diagnosis_causes_rollup", database, **slo)
    assert [(r["cause"], r["role"]) for r in approx] == [(r["cause"], r["role"]) for r in exact]
    assert any(r["role"] == "primary" for r in exact)
    slowest = _row(client, "slowest_requests", database, limit=Q.SLOWEST_KEPT)
    assert _row(client, "slowest_requests_rollup", database) == slowest and len(slowest) == Q.SLOWEST_KEPT
    assert len(_row(client, "slowest_requests_rollup", database, limit=5)) == 5


def _split(w: spangen.Workload) -> tuple[list, list]:
    spans = spangen.build_spans(w)
    server = [s for s in spans if s.resource.attributes["service.name"] == w.server_service]
    return server, [s for s in spans if s not in server]


def test_a_request_counts_once_however_its_spans_are_split(clickhouse, client):
    """Server spans, a sealing pass, then the client spans: the request was sealed with what had
    arrived (its client part is left out of the rollup, never counted as a second request); spans
    that all arrive before the pass count with both views; passes repeated change nothing."""
    late = _stopped_database(client)
    server, client_spans = _split(spangen.generate(30, seed=4))
    spangen.insert_spans(server, clickhouse.url, late)
    rollup.seal_now(client, late)
    spangen.insert_spans(client_spans, clickhouse.url, late)
    for _ in range(2):
        rollup.seal_now(client, late)
        report = B.budget(client, database=late, since=None, exact=False)
        assert (report.requests, report.with_client, report.with_server) == (30, 0, 30)
    exact = B.budget(client, database=late, since=None)
    assert (exact.requests, exact.with_client) == (30, 30)

    on_time = _stopped_database(client)
    server, client_spans = _split(spangen.generate(30, seed=5))
    spangen.insert_spans(client_spans, clickhouse.url, on_time)
    spangen.insert_spans(server, clickhouse.url, on_time)
    rollup.refresh_live(client, on_time)
    live = B.budget(client, database=on_time, since=None, exact=False)  # not sealed yet: the live states
    assert client.query(f"SELECT count() FROM {on_time}.{sketch.ROLLUP_TABLE}").result_rows[0][0] == 0
    for _ in range(2):
        rollup.seal_now(client, on_time)
        report = B.budget(client, database=on_time, since=None, exact=False)
        assert (report.requests, report.with_client, report.with_server) == (30, 30, 30)
        for name, stat in report.distributions.items():  # sealed or live: the same states
            want = live.distributions[name]
            assert (stat.p50, stat.p90, stat.p99) == (want.p50, want.p90, want.p99), name
            assert stat.mean == (None if want.mean is None else pytest.approx(want.mean, rel=1e-12)), name
    assert client.query(f"SELECT sum(requests) FROM {on_time}.{sketch.ROLLUP_TABLE}").result_rows[0][0] == 30


def test_the_views_seal_and_refresh_on_their_own(clickhouse, client):
    database = new_database(client, "rollup")
    CS.apply(client, rollup.statements(database, wait_s=0, every_s=1))  # re-created: a pass a second
    try:
        spangen.emit(spangen.generate(12, seed=6), clickhouse.url, database, transport="insert")
        deadline, sealed = time.monotonic() + 30, 0
        while time.monotonic() < deadline and sealed < 12:
            time.sleep(0.5)
            sealed = client.query(f"SELECT sum(requests) FROM {database}.{sketch.ROLLUP_TABLE}").result_rows[0][0]
        assert sealed == 12
        # the live states, recomputed against the new end by a live pass that began after the seal
        # (both times on ClickHouse's clock, whole seconds): none left
        sealed_at = client.query("SELECT now()").result_rows[0][0]

        def live_pass() -> bool:
            sql = (
                "SELECT count() FROM system.view_refreshes WHERE database = {db:String} "
                "AND view = {view:String} AND last_success_time > {t:DateTime}"
            )
            args = {"db": database, "view": rollup.LIVE_VIEW, "t": sealed_at}
            return client.query(sql, parameters=args).result_rows[0][0] > 0

        assert wait_until(live_pass, 3 * rollup.LIVE_EVERY_S, 0.2) is not None
        assert B.budget(client, database=database, since="1h", exact=False).requests == 12
    finally:
        rollup.stop_refreshes(client, database)


def test_a_new_term_is_one_line_and_upgrades_in_place(clickhouse, client, monkeypatch):
    """A term appended to the list: applying the schema again adds its state columns to a rollup
    that has rows, and the next pass fills them."""
    database = _stopped_database(client)
    w = spangen.generate(20, seed=8)
    spangen.emit(w, clickhouse.url, database, transport="insert")
    rollup.seal_now(client, database)
    # the rollup's SQL reads the lists where they are defined (queries.rollups), not the package's re-export
    monkeypatch.setattr(QR, "ROLLUP_TERMS", (*QR.ROLLUP_TERMS, ("double_ingress_ms", "ingress_ms * 2")))
    monkeypatch.setattr(QR, "ROLLUP_POSITIONS", (*QR.ROLLUP_POSITIONS, "double_ingress_ms"))
    CS.apply(client, rollup.statements(database))
    rollup.stop_refreshes(client, database)
    spangen.emit(spangen.generate(20, seed=9), clickhouse.url, database, transport="insert", seed=9)
    rollup.seal_now(client, database)
    mean, rows = client.query(
        f"SELECT avgForEachMerge({sketch.MEANS_COLUMN})[{len(QR.ROLLUP_POSITIONS)}], sum(requests) "
        f"FROM {database}.{sketch.ROLLUP_TABLE}"
    ).result_rows[0]
    newer = spangen.generate(20, seed=9).requests
    assert rows == 40 and mean == pytest.approx(2 * np.mean([r.ingress_ms for r in newer]), rel=1e-9)


def test_every_term_has_a_stored_position():
    """Sealed rows keep the positions of their arrays: a term needs one, appended (not inserted)."""
    names = [name for name, _ in Q.ROLLUP_TERMS]
    assert len(set(Q.ROLLUP_POSITIONS)) == len(Q.ROLLUP_POSITIONS)
    assert not set(names) - set(Q.ROLLUP_POSITIONS), (
        "give the new term the next free rollup position (analysis/terms.py, or queries/rollups.py _SERIES_POSITIONS)"
    )
