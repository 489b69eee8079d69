"""The server's first-chunk delivery on a real stack (embedded ClickHouse, collector, the reference
server with the tiny model, `phaselens bench`): with 8 concurrent streams the server's event loop is
late to write, the `first_chunk` term takes that time, and the residual keeps network + client only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phaselens.analysis.budget import budget
from phaselens.stack import Stack

REQUESTS = 48
STREAMS = 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    with Stack(str(tmp_path_factory.mktemp("stack")), server_args=("--max-num-seqs", str(STREAMS))) as stack:
        bench = subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", stack.server_url, "--model", "tiny",
             "--concurrency", str(STREAMS), "--requests", str(REQUESTS), "--input-len", "48",
             "--output-len", "24", "--ignore-eos", "--quiet"],
            env=stack.otel_env("bench"), capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert stack.server.stop(30) == 0 and stack.collector.stop(30) == 0  # flush, then drain
        with stack.client() as ch:
            yield budget(ch, database=stack.database, since=None)


def test_the_mean_budget_adds_up_to_client_ttft_with_the_first_chunk_term(report):
    assert (report.requests, report.with_client, report.errors, report.no_output) == (REQUESTS, REQUESTS, 0, 0)
    terms = {c.name: c.ms for c in report.components}
    assert list(terms) == ["ingress_ms", "queue_ms", "prefill_ms", "first_token_ms", "first_chunk_ms",
                           "residual_ms"]
    mean_sum = sum(stat.mean for stat in terms.values())
    assert mean_sum == pytest.approx(report.distributions["client_ttft_ms"].mean, rel=1e-9)
    split = sum(report.distributions[k].mean for k in ("loop_wait_ms", "encode_ms", "write_ms"))
    assert split == pytest.approx(terms["first_chunk_ms"].mean, rel=1e-9)
    assert report.distributions["server_ttfc_ms"].mean == pytest.approx(
        report.distributions["server_ttft_ms"].mean + terms["first_chunk_ms"].mean, rel=1e-9)


def test_the_residual_is_loopback_sized_and_first_chunk_takes_the_servers_share(report):
    """Loopback: the network is microseconds; the residual is the client's own reading of the chunk
    (on 2 cores it competes with the server for the CPU, hence the p90 bound). A server socket
    without TCP_NODELAY put ~40 ms (the client's delayed ACK) into most residuals: p50 catches it."""
    terms = {c.name: c.ms for c in report.components}
    residual = terms["residual_ms"]
    assert 0 <= residual.p50 < 5 and residual.p90 < 20, residual
    # the server's first-chunk time is its event loop getting round to the output, not the transport
    assert report.distributions["loop_wait_ms"].mean > report.distributions["write_ms"].mean
    assert terms["first_chunk_ms"].p50 > 0
    # the stream's end, the same way
    e2e_residual = report.distributions["e2e_residual_ms"]
    assert 0 <= e2e_residual.p50 < 5 and e2e_residual.p90 < 20, e2e_residual
