"""Per-request facts and the budget against hand-computed truths: spans with known durations sent
through the real OTLP exporter and our collector into the embedded ClickHouse."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from phaselens.analysis import queries as Q
from phaselens.analysis.budget import latency_budget as B
from phaselens.common.slo import SLO
from phaselens.instrumentation import names as n
from tests import spangen
from tests.analysis_fixtures import client, loaded, new_database, rows_by_trace, stat

HOUR_NS = 3600 * 10**9


@pytest.fixture(scope="module")
def mixed(clickhouse):
    """Requests of every kind (server-only, aborted, preempted) plus engine steps, via OTLP."""
    w = spangen.generate(60, seed=3, server_only_every=5, abort_every=7, preempt_every=6, n_steps=48)
    return w, loaded(clickhouse, w)


@pytest.fixture(scope="module")
def clean(clickhouse):
    """Completed requests with both views, via OTLP."""
    w = spangen.generate(80, seed=11, n_steps=0)
    return w, loaded(clickhouse, w)


def test_request_rows_equal_the_truth(client, mixed):
    w, db = mixed
    rows = rows_by_trace(client, db)
    assert len(rows) == len(w.requests)
    for r in w.requests:
        row = rows[r.trace_id]
        for col, want in (
            ("ingress_ms", r.ingress_ms),
            ("queue_ms", sum(r.queue_waits_ms)),
            ("prefill_ms", r.prefill_ms),
            ("first_token_ms", r.first_token_ms),
            ("decode_ms", r.decode_ms),
            ("delivery_ms", r.delivery_ms),
            ("server_ttft_ms", r.server_ttft_ms),
            ("client_ttft_ms", r.client_ttft_ms),
            ("client_e2e_ms", r.client_e2e_ms),
            ("residual_ms", r.residual_ms),
            ("server_tpot_ms", r.tpot_ms),
            ("itl_p99_ms", r.itl_p99_ms),
            ("stall_ms", r.stall_ms),
            ("clock_offset_estimate_ms", r.clock_offset_estimate_ms),
        ):
            assert row[col] == pytest.approx(want, abs=1e-6), (col, r)
        assert (row["preemptions"], row["prefill_chunks"], row["status"]) == (r.preemptions, r.prefill_chunks, r.status)
        assert (row["input_tokens"], row["output_tokens"], row["model"]) == (r.input_tokens, r.output_tokens, r.model)
        assert row["request_id"] == r.request_id
        assert row["error_type"] == (n.ERROR_CLIENT_DISCONNECTED if r.aborted else None)
        assert row["service"] == w.server_service


def test_kinds_are_all_present(client, mixed):
    w, db = mixed
    rows = rows_by_trace(client, db)
    server_only = [r for r in w.requests if not r.has_client]
    assert server_only and all(
        rows[r.trace_id]["client_ttft_ms"] is None and rows[r.trace_id]["residual_ms"] is None for r in server_only
    )
    assert sum(r.aborted for r in w.requests) == sum(row["status"] == "error" for row in rows.values()) > 0
    assert any(row["preemptions"] == 1 for row in rows.values())


def test_ttft_terms_sum_to_server_ttft(client, mixed):
    """ingress + queue + prefill + first_token = server TTFT within 1 % (no preemption in decode)."""
    w, db = mixed
    rows = rows_by_trace(client, db)
    checked = 0
    for r in w.requests:
        if r.preemptions:
            continue
        row = rows[r.trace_id]
        total = row["ingress_ms"] + row["queue_ms"] + row["prefill_ms"] + row["first_token_ms"]
        assert total == pytest.approx(row["server_ttft_ms"], rel=0.01)
        checked += 1
    assert checked > 40


def test_phase_span_durations_alone_give_the_same_rows(clickhouse, client):
    """Without the phaselens.*_ms attributes the figures come from the phase spans' own Durations."""
    w = spangen.generate(20, seed=5, server_only_every=4)
    db = loaded(clickhouse, w, transport="insert", phase_attributes=False)
    rows = rows_by_trace(client, db)
    for r in w.requests:
        row = rows[r.trace_id]
        for col, want in (
            ("ingress_ms", r.ingress_ms),
            ("queue_ms", r.queue_waits_ms[0]),
            ("prefill_ms", r.prefill_ms),
            ("first_token_ms", r.first_token_ms),
            ("decode_ms", r.decode_ms),
            ("delivery_ms", r.delivery_ms),
        ):
            assert row[col] == pytest.approx(want, abs=1e-6), col


def test_budget_equals_the_hand_computed_one(client, clean):
    w, db = clean
    report = B.budget(client, database=db, since=None)
    assert (report.requests, report.with_client, report.errors, report.reference) == (80, 80, 0, "client")
    truth = {
        "ingress_ms": [r.ingress_ms for r in w.requests],
        "queue_ms": [r.queue_waits_ms[0] for r in w.requests],
        "prefill_ms": [r.prefill_ms for r in w.requests],
        "first_token_ms": [r.first_token_ms for r in w.requests],
        "first_chunk_ms": [r.first_chunk_ms for r in w.requests],
        "residual_ms": [r.residual_ms for r in w.requests],
    }
    # the phaselens tree separates ingress and first token: no before-the-engine remainder; these
    # spans carry no kernel receive stamps: the two edges are unobserved, not 0 ms
    assert report.span_models == ["phaselens"] and report.unseparated == []
    for c in report.components:
        if c.name in ("before_engine_ms", "inbound_ms", "held_back_ms", "client_ms", "client_late_est_ms"):
            assert c.ms.values() == (None, None, None, None), c.name
            continue
        assert c.ms.values() == pytest.approx(stat(truth[c.name]), abs=1e-6), c.name
    ttft = stat(r.client_ttft_ms for r in w.requests)
    assert report.distributions["client_ttft_ms"].values() == pytest.approx(ttft, abs=1e-6)
    assert report.distributions["server_ttft_ms"].values() == pytest.approx(
        stat(r.server_ttft_ms for r in w.requests), abs=1e-6
    )
    tpot = stat(r.tpot_ms for r in w.requests)
    assert report.distributions["client_tpot_ms"].values() == pytest.approx(tpot, abs=1e-6)
    assert sum(c.share.mean or 0 for c in report.components) == pytest.approx(1.0, abs=1e-9)
    prefill = next(c for c in report.components if c.name == "prefill_ms")
    assert prefill.share.p99 == pytest.approx(prefill.ms.p99 / ttft[2])


def test_tail_attribution(client, clean):
    w, db = clean
    tail = B.budget(client, database=db, since=None).tail
    ttfts = np.array([r.client_ttft_ms for r in w.requests])
    threshold = float(np.percentile(ttfts, 99))
    in_tail = [r for r in w.requests if r.client_ttft_ms > threshold]
    assert tail.threshold_ms == pytest.approx(threshold) and tail.requests == len(in_tail) >= 1
    prefill = next(c for c in tail.components if c.name == "prefill_ms")
    want = np.mean([r.prefill_ms for r in in_tail]) - np.median([r.prefill_ms for r in w.requests])
    assert prefill.delta_ms == pytest.approx(want, abs=1e-6)
    lacking = next(c for c in tail.components if c.name == "before_engine_ms")  # NULL for this span model
    assert (lacking.tail_mean_ms, lacking.median_ms, lacking.delta_ms) == (None, None, None)  # not a 0 ms mean
    grew = [c for c in tail.components if c.delta_ms is not None]
    assert tail.grew_most == max(grew, key=lambda c: c.delta_ms).name


def test_goodput_and_attainment(client, mixed):
    w, db = mixed
    report = B.budget(client, database=db, since=None, slo=SLO(ttft_ms=40, tpot_ms=12))
    good = [
        r
        for r in w.requests
        if r.status == "ok"
        and (r.client_ttft_ms if r.has_client else r.server_ttft_ms) <= 40
        and (r.tpot_ms or 0) <= 12
    ]
    window_s = (
        max(r.start_ns + spangen._ns(r.server_e2e_ms) for r in w.requests) - min(r.start_ns for r in w.requests)
    ) / 1e9
    g = report.goodput
    assert g.good_requests == len(good) > 0
    assert g.window_s == pytest.approx(window_s, rel=1e-9)
    assert g.goodput_rps == pytest.approx(len(good) / window_s)
    assert g.attainment == pytest.approx(len(good) / len(w.requests))


def test_decode_stalls_match_their_definition(client, mixed):
    w, db = mixed
    baseline, mixed_steps, stall, request_stall = spangen.expected_stalls(w.steps)
    s = B.budget(client, database=db, since=None).stalls
    assert (s.steps, s.mixed_steps) == (len(w.steps), mixed_steps) and mixed_steps > 0
    assert s.baseline_ms == pytest.approx(baseline, abs=1e-9)
    assert s.stall_ms == pytest.approx(stall, abs=1e-6)
    assert s.request_stall_ms == pytest.approx(request_stall, abs=1e-6)


def test_replayed_batches_change_nothing(clickhouse, client):
    """At-least-once delivery: a spool replay re-sends a batch with its deduplication token; the
    spans table and every per-request figure stay as they were."""
    w = spangen.generate(15, seed=8, preempt_every=3)
    db = loaded(clickhouse, w, transport="insert", token_prefix="batch")
    before = rows_by_trace(client, db)
    spangen.emit(w, clickhouse.url, db, transport="insert", token_prefix="batch")
    assert client.query(f"SELECT count() FROM {db}.otel_traces").result_rows[0][0] == sum(
        9 + r.prefill_chunks + r.preemptions for r in w.requests
    )
    assert rows_by_trace(client, db) == before


def test_clock_shift_and_wall_step_move_only_the_offset_estimate(clickhouse, client):
    """Client clock ±1 h, and a 2 s wall step mid-request: every budget figure is unchanged."""
    kw = {"n_requests": 30, "seed": 21, "n_steps": 12, "server_only_every": 6}
    reports, rows = [], []
    for shift, step in ((0, 0), (HOUR_NS, 0), (-HOUR_NS, 2 * 10**9)):
        w = spangen.generate(**kw, client_clock_shift_ns=shift, wall_step_ns=step)
        db = loaded(clickhouse, w)
        reports.append(B.budget(client, database=db, since=None, slo=SLO(ttft_ms=40, tpot_ms=12)).to_dict())
        rows.append((w, rows_by_trace(client, db)))
    for r in reports[1:]:
        assert {**r, "filters": None} == {**reports[0], "filters": None}
    (w0, rows0), (w1, rows1), (w2, rows2) = rows
    for a, b, c in zip(w0.requests, w1.requests, w2.requests, strict=False):
        if not a.has_client:
            continue
        off0 = rows0[a.trace_id]["clock_offset_estimate_ms"]
        assert rows1[b.trace_id]["clock_offset_estimate_ms"] == pytest.approx(off0 - 3_600_000, abs=1e-3)
        assert rows2[c.trace_id]["clock_offset_estimate_ms"] == pytest.approx(off0 + 3_600_000 - 1_000, abs=1e-3)


def test_naive_timestamp_subtraction_is_wrong_by_the_clock_offset(clickhouse, client):
    """Documentation of why: server first-token end − client start mixes two clocks."""
    w = spangen.generate(10, seed=4, client_clock_shift_ns=HOUR_NS)
    db = loaded(clickhouse, w, transport="insert")
    sql, params = Q.render_cli("naive_ttft", database=db)
    naive = dict(client.query(sql, parameters=params).result_rows)
    rows = rows_by_trace(client, db)
    for r in w.requests:
        error_ms = naive[r.trace_id] - rows[r.trace_id]["client_ttft_ms"]
        assert error_ms == pytest.approx(-3_600_000, abs=10)  # off by the hour, not by network time
        assert rows[r.trace_id]["client_ttft_ms"] == pytest.approx(r.client_ttft_ms, abs=1e-6)


def test_older_exporter_enum_spellings_give_the_same_rows(clickhouse, client):
    """Older collector exporters wrote SPAN_KIND_SERVER / STATUS_CODE_ERROR: same figures."""
    from phaselens.collectors import render
    from phaselens.collectors.schema import INSERT_COLUMNS
    from phaselens.collectors.writer import ClickHouseSink
    from tests.rowbinary import read_rows, write_rows

    w = spangen.generate(12, seed=14, abort_every=3, server_only_every=4)
    block, _ = render.render(encode_spans(spangen.build_spans(w, seed=14)).SerializeToString())
    kind, status = INSERT_COLUMNS.index("SpanKind"), INSERT_COLUMNS.index("StatusCode")
    old = [
        (
            *row[:kind],
            f"SPAN_KIND_{row[kind].upper()}",
            *row[kind + 1 : status],
            f"STATUS_CODE_{row[status].upper()}",
            *row[status + 1 :],
        )
        for row in read_rows(block)
    ]
    db = new_database(client)
    sink = ClickHouseSink(clickhouse.url, db)
    sink.insert([write_rows(old)], token="old-exporter")
    sink.close()
    rows = rows_by_trace(client, db)
    assert {"SPAN_KIND_SERVER", "STATUS_CODE_ERROR"} <= {r[kind] for r in old} | {r[status] for r in old}
    for r in w.requests:
        row = rows[r.trace_id]
        assert (row["status"], row["client_ttft_ms"] is None) == (r.status, not r.has_client)
        assert row["server_ttft_ms"] == pytest.approx(r.server_ttft_ms, abs=1e-6)
        assert row["residual_ms"] == pytest.approx(r.residual_ms, abs=1e-6)
