"""One percentile definition everywhere: Python (server span attributes, client span attributes,
bench statistics) and SQL (`quantileExactInclusive`) give the same number for the same values."""

from __future__ import annotations

import random

import numpy as np
import pytest

from phaselens.common.quantile import quantile
from phaselens.instrumentation import names as N
from phaselens.instrumentation.client import traced_client as client
from phaselens.instrumentation.hotpath.timeline import RequestTimeline
from phaselens.instrumentation.pipeline.phases import compute_phases
from phaselens.instrumentation.pipeline.spans import decode_attributes
from phaselens.loadgen import metrics
from tests.instrumentation_fixtures import ScriptedClock

QS = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)


def test_linear_interpolation_between_closest_ranks():
    values = [10.0, 20.0, 30.0, 40.0, 1000.0]
    # h = q · (n − 1): p50 → h = 2 → 30; p90 → h = 3.6 → 40 + 0.6 · 960; p99 → h = 3.96
    assert quantile(values, 0.5) == 30.0
    assert quantile(values, 0.9) == pytest.approx(40 + 0.6 * 960)
    assert quantile(values, 0.99) == pytest.approx(40 + 0.96 * 960)
    assert (quantile(values, 0.0), quantile(values, 1.0), quantile([7.0], 0.99), quantile([], 0.5)) == (
        10,
        1000,
        7,
        None,
    )
    assert quantile([1.0, float("inf")], 0.5) == float("inf")  # failures counted as +∞ stay +∞


def test_equals_numpy_linear():
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101, 1000):
        values = sorted(rng.expovariate(1 / 20) for _ in range(n))
        expected = np.quantile(values, QS, method="linear")
        assert [quantile(values, q) for q in QS] == pytest.approx(expected.tolist(), rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_equals_clickhouse_quantile_exact_inclusive(ch_client, n):
    rng = random.Random(n)
    values = [round(rng.lognormvariate(2, 1), 6) for _ in range(n)]
    row = ch_client.query(
        "SELECT quantilesExactInclusive(0, 0.1, 0.5, 0.9, 0.99, 1)(x), "
        "quantileExactInclusive(0.99)(x) FROM (SELECT arrayJoin({v:Array(Float64)}) AS x)",
        parameters={"v": values},
    ).result_rows[0]
    ordered = sorted(values)
    assert list(row[0]) == pytest.approx([quantile(ordered, q) for q in QS], rel=1e-12)
    assert row[1] == pytest.approx(quantile(ordered, 0.99), rel=1e-12)


def test_server_and_client_itl_percentiles_agree_on_the_same_gaps():
    """Token stamps at the server and chunk arrivals at the client with identical gaps: the
    server's llm.decode ITL p50/p99, the client span's and `phaselens bench`'s are one number."""
    gaps_ns = [8_000_000, 9_000_000, 8_500_000, 40_000_000, 8_200_000, 9_100_000, 12_000_000]
    clock = ScriptedClock(now_ns=1_000_000_000)
    timeline = RequestTimeline(clock)
    clock.advance(1_000)
    timeline.enqueued()
    clock.advance(1_000)
    timeline.scheduled()
    clock.advance(5_000_000)
    timeline.first_token()
    for gap in gaps_ns:
        clock.advance(gap)
        timeline.token(1)
    clock.advance(1_000)
    timeline.finished("length")
    timeline.responded_ts = clock.advance(1_000)
    server = decode_attributes(compute_phases(timeline))

    result = client.StreamResult("completions", "m", sent_ts=0)
    result.chunk_ts = [0, *np.cumsum(gaps_ns).tolist()]
    result.chunk_tokens = [1] * len(result.chunk_ts)
    result.first_chunk_ts = result.first_output_ts = result.chunk_ts[0]
    result.last_chunk_ts = result.done_ts = result.chunk_ts[-1]
    client.compute_metrics(result)
    client_attrs = client._result_attributes(result)
    bench = metrics.stat(result.itl_ms, (50, 99)).percentiles

    expected_p99_ms = quantile(sorted(gaps_ns), 0.99) / 1e6
    assert expected_p99_ms != max(gaps_ns) / 1e6  # nearest rank would have said the max
    for p, server_key, client_key in (
        (50, N.PL_ITL_P50_MS, N.PL_CLIENT_ITL_P50_MS),
        (99, N.PL_ITL_P99_MS, N.PL_CLIENT_ITL_P99_MS),
    ):
        assert server[server_key] == pytest.approx(client_attrs[client_key], rel=1e-12)
        assert bench[f"p{p}"] == pytest.approx(server[server_key], rel=1e-12)
    assert server[N.PL_ITL_P99_MS] == pytest.approx(expected_p99_ms, rel=1e-12)
