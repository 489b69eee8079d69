"""The analysis views over spans built by the real server instrumentation (phaselens.instrumentation.server.telemetry on
a scripted clock, as its own tests drive it): chunked prefill and a preemption during decode."""

from __future__ import annotations

import pytest

from tests import spangen
from tests.analysis_fixtures import client, new_database, rows_by_trace
from tests.instrumentation_fixtures import TRACE_ID, make_rig, script_request


def test_scripted_request_through_the_real_instrumentation(clickhouse, client):
    rig = make_rig()
    script_request(rig)
    db = new_database(client, "realspans")
    spangen.insert_spans(rig.spans(), clickhouse.url, db)
    row = rows_by_trace(client, db)[TRACE_ID]
    # phase boundaries of script_request (instrumentation/pipeline/phases.py): received 1.000 ms, enqueued
    # 1.100, scheduled 1.400, prefill end 1.700, first token 1.720, a 0.140 ms wait in decode,
    # last token 1.970, responded 1.990
    expected = {
        "ingress_ms": 0.1,
        "queue_ms": 0.44,
        "prefill_ms": 0.3,
        "first_token_ms": 0.02,
        "server_ttft_ms": 0.72,
        "decode_ms": 0.25,
        "delivery_ms": 0.02,
        "server_tpot_ms": 0.25 / 6,
    }
    for col, want in expected.items():
        assert row[col] == pytest.approx(want, abs=1e-9), col
    assert (row["preemptions"], row["prefill_chunks"], row["output_tokens"], row["input_tokens"]) == (1, 2, 7, 12)
    assert row["ingress_ms"] + 0.3 + row["prefill_ms"] + row["first_token_ms"] == pytest.approx(row["server_ttft_ms"])
    assert (row["status"], row["model"], row["request_id"]) == ("ok", "tiny", "cmpl-1")
    assert row["client_ttft_ms"] is None and row["residual_ms"] is None  # no client span in this trace
    steps = list(client.query(f"SELECT * FROM {db}.phaselens_steps").named_results())
    assert len(steps) == 1
    assert (steps[0]["prefill_tokens"], steps[0]["decode_tokens"], steps[0]["linked_requests"]) == (16, 1, 1)
    assert steps[0]["duration_ms"] == pytest.approx(0.03)
