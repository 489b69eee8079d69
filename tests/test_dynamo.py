"""NVIDIA Dynamo 1.6.1 live (its Rust frontend and router, the mocker as its engine), aggregated and
P/D, tracing to the real collector into the real embedded ClickHouse: every request is budgeted from
Dynamo's own spans and joined to its client view; Dynamo talks over loopback only; a worker killed
mid-request fails its request in the client and in the budget, and nothing hangs
(docs/other-servers.md#dynamo). One Dynamo deployment per mode for the module."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest
from rich.console import Console

from phaselens.analysis.budget import dynamo_budget as dyn
from phaselens.analysis.rollup import rollup
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from phaselens.collectors.service import Collector
from phaselens.commands import budget as budget_command
from phaselens.common.process import LOOPBACK
from phaselens.instrumentation import names as n
from phaselens.integrations.dynamo.launcher import DynamoDeployment, default_python
from tests.cli_fixtures import bench_argv, run_command
from tests.source_tree import ROOT

DYNAMO_PYTHON = default_python(ROOT)
pytestmark = pytest.mark.skipif(
    DYNAMO_PYTHON is None,
    reason="no Dynamo virtualenv: run ./setup.sh --dynamo (or set PHASELENS_DYNAMO_PYTHON to a python with ai-dynamo)",
)
REQUESTS, OUTPUT_TOKENS, PROMPT_TOKENS = 6, 8, 40
DB = "dynamo_live"
COLUMNS = (
    "trace_id, status, span_model, server_start_time, client_ttft_ms, server_ttft_ms, client_ms, residual_ms, "
    "prefill_instance, decode_instance, frontend_dispatch_ms, prefill_call_ms, kv_transfer_est_ms, "
    "prefill_worker_ms, prefill_busy_ms, prefill_idle_ms, decode_busy_ms, decode_idle_ms, pd_span_model"
)
PUB_BOUND = re.compile(r'"ZMQ PUB transport bound[^\n]*"endpoint":"tcp://0\.0\.0\.0:(\d+)"')


@pytest.fixture(scope="module")
def pipeline(clickhouse, tmp_path_factory):
    """A database with the whole schema, a collector writing into it, and a client of it."""
    client = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
    client.command(f"DROP DATABASE IF EXISTS {DB}")
    collector_schema.apply(client, ddl.all_statements(DB))
    rollup.stop_refreshes(client, DB)  # the tests read the requests view: no rollup passes meanwhile
    spool = str(tmp_path_factory.mktemp("spool"))
    collector = Collector(clickhouse.url, database=DB, spool_dir=spool, flush_interval_s=0.05).start()
    yield client, f"http://{LOOPBACK}:{collector.grpc_port}", clickhouse.url
    collector.stop()
    client.close()


def _deploy(tmp: Path, endpoint: str, disagg: bool):
    assert DYNAMO_PYTHON is not None  # the module is skipped without it
    with DynamoDeployment(DYNAMO_PYTHON, tmp / "dynamo", tmp / "logs", endpoint, disagg=disagg) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def aggregated(pipeline, tmp_path_factory):
    yield from _deploy(tmp_path_factory.mktemp("dynamo-agg"), pipeline[1], disagg=False)


@pytest.fixture(scope="module")
def disaggregated(pipeline, tmp_path_factory):
    yield from _deploy(tmp_path_factory.mktemp("dynamo-pd"), pipeline[1], disagg=True)


def _bench(url: str, endpoint: str, out: Path, *args: str, timeout_s: float = 120) -> subprocess.Popen:
    """One bounded `phaselens bench` child (client spans to the collector), its per-request lines in `out`."""
    env = {
        **os.environ,
        "OTEL_SERVICE_NAME": "phaselens-loadgen",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    argv = bench_argv(url, "--quiet", "--per-request", str(out), "--timeout", str(timeout_s), *args)
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _requests(url: str, endpoint: str, out: Path) -> list[dict]:
    shape = ("--input-len", str(PROMPT_TOKENS), "--output-len", str(OUTPUT_TOKENS), "--ignore-eos")
    bench = _bench(url, endpoint, out, "--concurrency", "2", "--requests", str(REQUESTS), *shape)
    _, err = bench.communicate(timeout=180)
    assert bench.returncode == 0, err[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _rows(client, trace_ids: list[str], want: int, timeout_s: float = 60) -> dict[str, dict]:
    """The requests' rows once each has its client view, Dynamo's frontend view and `want` workers' spans."""
    sql = f"SELECT {COLUMNS} FROM {DB}.phaselens_requests WHERE trace_id IN {{ids:Array(String)}}"
    deadline = time.monotonic() + timeout_s
    while True:
        result = client.query(sql, parameters={"ids": trace_ids})
        rows = {r[0]: dict(zip(result.column_names, r, strict=True)) for r in result.result_rows}
        workers = client.query(
            f"SELECT count() FROM {DB}.otel_traces WHERE SpanName = '{n.SPAN_DYNAMO_HANDLE}' "
            "AND TraceId IN {ids:Array(String)}",
            parameters={"ids": trace_ids},
        ).result_rows[0][0]
        done = len(rows) == len(trace_ids) and all(r["client_ttft_ms"] and r["server_ttft_ms"] for r in rows.values())
        if (done and workers == want * len(trace_ids)) or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def _served_rows(client, endpoint: str, url: str, folder, want: int) -> dict[str, dict]:
    """REQUESTS through `url`, every one answered; their rows once each has `want` worker spans."""
    lines = _requests(url, endpoint, folder / "requests.jsonl")
    assert [r["error_type"] for r in lines] == [None] * REQUESTS
    return _rows(client, [r["trace_id"] for r in lines], want=want)


@pytest.fixture(scope="module")
def aggregated_rows(pipeline, aggregated, tmp_path_factory):
    client, endpoint, _ = pipeline
    return _served_rows(client, endpoint, aggregated.url, tmp_path_factory.mktemp("agg"), want=1)


@pytest.fixture(scope="module")
def disaggregated_rows(pipeline, disaggregated, tmp_path_factory):
    client, endpoint, _ = pipeline
    return _served_rows(client, endpoint, disaggregated.url, tmp_path_factory.mktemp("pd"), want=2)


def _joined_to_the_client(rows: dict[str, dict]) -> None:
    """Every request: Dynamo's frontend continued the client's trace; its TTFT inside the client's."""
    assert len(rows) == REQUESTS
    for row in rows.values():
        assert (row["status"], row["span_model"]) == ("ok", n.SPAN_MODEL_DYNAMO)
        assert row["server_start_time"] is not None  # the time column `--since` reads
        assert 0 < row["server_ttft_ms"] < row["client_ttft_ms"]
        want = row["client_ttft_ms"] - row["server_ttft_ms"] - (row["client_ms"] or 0)
        assert row["residual_ms"] == pytest.approx(want, abs=1e-6)


def test_aggregated_every_request_is_budgeted_from_dynamos_spans(aggregated_rows):
    _joined_to_the_client(aggregated_rows)
    for row in aggregated_rows.values():
        # no prefill worker: every P/D term unobserved (NULL), never 0
        pd = {k: v for k, v in row.items() if k.startswith(("prefill_", "decode_", "frontend_", "kv_"))}
        assert pd == dict.fromkeys(pd) and row["pd_span_model"] is None


def test_pd_every_request_is_budgeted_from_both_workers_spans(disaggregated_rows):
    _joined_to_the_client(disaggregated_rows)
    for row in disaggregated_rows.values():
        assert (row["prefill_instance"], row["decode_instance"], row["pd_span_model"]) == (
            "dynamo-worker-prefill",
            "dynamo-worker-decode",
            n.SPAN_MODEL_DYNAMO,
        )
        # the frontend's TTFT in its terms, one clock: dispatch + prefill call + KV estimate
        parts = row["frontend_dispatch_ms"] + row["prefill_call_ms"] + row["kv_transfer_est_ms"]
        assert parts == pytest.approx(row["server_ttft_ms"], abs=1e-6)
        # each part inside the TTFT; which of dispatch and the prefill call is longer is the machine's
        # (a loaded machine's frontend took 28 ms to dispatch a 21 ms prefill call)
        assert 0 <= row["frontend_dispatch_ms"] < row["server_ttft_ms"]
        assert 0 < row["prefill_call_ms"] < row["server_ttft_ms"]
        assert min(row[k] for k in ("prefill_worker_ms", "prefill_busy_ms", "prefill_idle_ms", "decode_busy_ms")) > 0
        assert row["prefill_busy_ms"] < row["prefill_worker_ms"]


def test_phaselens_budget_prints_the_dynamo_budget_of_both_modes(pipeline, aggregated_rows, disaggregated_rows, capsys):
    client, _, url = pipeline
    report = dyn.dynamo_budget(client, database=DB, since="10m")
    assert (report.requests, report.disaggregated, report.errors) == (2 * REQUESTS, REQUESTS, 0)
    mean = {name: stat.mean for name, stat in report.terms.items()}
    assert None not in (mean["server_ttft_ms"], mean["kv_transfer_est_ms"], mean["residual_ms"], mean["client_ms"])
    # our client takes no read stamps behind the first chunk here: the late-client estimate is
    # unobserved at every statistic, never 0
    assert dataclasses.astuple(report.terms["client_late_est_ms"]) == (None, None, None, None)
    printed_table = Console(width=200, record=True)
    printed_table.print(dyn.to_rich(report))
    row = next(line for line in printed_table.export_text().splitlines() if "client_late_est_ms" in line)
    assert "client_late_est_ms (estimate) unobserved" in row and "0.00" not in row, row
    ttft = sum(mean[t] or 0 for t in ("client_ms", "client_late_est_ms", "residual_ms", "server_ttft_ms"))
    assert ttft == pytest.approx(report.side["client_ttft_ms"].mean, rel=1e-9)
    # the P/D terms: means over the P/D requests only (an aggregated request's are NULL, not 0)
    frontend = sum(mean[t] for t in ("frontend_dispatch_ms", "prefill_call_ms", "kv_transfer_est_ms"))
    assert 0 < frontend < mean["server_ttft_ms"] * 3
    capsys.readouterr()
    argv = ("budget", "--clickhouse", url, "--database", DB, "--since", "10m", "--exact", "--format", "json")
    assert run_command(budget_command.register, *argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["requests"], printed["dynamo"]["requests"], printed["disaggregated"]["requests"]) == (
        2 * REQUESTS,
        2 * REQUESTS,
        REQUESTS,
    )


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _tcp_sockets(pid: int) -> list[tuple[str, str, int, str]]:
    """(local address, remote address, local port, state) of the process's TCP sockets, hex as in /proc."""
    inodes, out = _socket_inodes(pid), []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                (local, port), (remote, _) = f[1].split(":"), f[2].split(":")
                out.append((local, remote, int(port, 16), f[3]))
    return out


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
ANY_HEX = {"00000000", "00000000000000000000000000000000"}
LISTEN = "0A"


def test_dynamo_talks_over_loopback_only(disaggregated, disaggregated_rows):
    """Every connection loopback to loopback; the only listeners not on loopback are the ZMQ PUB
    sockets Dynamo binds on 0.0.0.0 (hardcoded in its zmq transport), as its logs name them."""
    sockets = [s for pid in disaggregated.pids() for s in _tcp_sockets(pid)]
    connected = [s for s in sockets if s[3] != LISTEN]
    assert connected and all(s[0] in LOOPBACK_HEX and s[1] in LOOPBACK_HEX for s in connected)
    wide_listeners = [s for s in sockets if s[3] == LISTEN and s[0] not in LOOPBACK_HEX]
    assert {s[0] for s in wide_listeners} <= ANY_HEX  # 0.0.0.0, never the machine's other interface
    wide = {s[2] for s in wide_listeners}
    logs = "".join(Path(c.log_path).read_text() for c in (disaggregated.frontend, *disaggregated.workers.values()))
    assert wide == {int(p) for p in PUB_BOUND.findall(logs)}


def _inflight(url: str) -> float:
    """Requests in flight at Dynamo's frontend (its Prometheus gauge)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(m) for m in re.findall(r"^dynamo_frontend_inflight_requests\{[^}]*\} (\S+)$", text, re.MULTILINE))


def test_a_worker_killed_mid_request_fails_the_request_and_nothing_hangs(
    pipeline, aggregated, aggregated_rows, tmp_path
):
    """Last of the aggregated worker's tests: it ends that worker."""
    client, endpoint, _ = pipeline
    out = tmp_path / "requests.jsonl"
    shape = ("--input-len", str(PROMPT_TOKENS), "--output-len", "1500", "--ignore-eos")
    bench = _bench(aggregated.url, endpoint, out, "--concurrency", "1", "--requests", "1", *shape, timeout_s=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _inflight(aggregated.url) < 1:
        time.sleep(0.2)
    time.sleep(1.0)  # the request is decoding: ~5 ms a token of 1500
    os.kill(aggregated.workers["dynamo-worker"].proc.pid, signal.SIGKILL)
    _, err = bench.communicate(timeout=90)  # the client's own timeout (60 s) bounds it
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["error_type"] is not None, err[-2000:]
    (row,) = _rows(client, [line["trace_id"]], want=0, timeout_s=30).values()
    assert (row["status"], row["span_model"]) == ("error", n.SPAN_MODEL_DYNAMO)
    assert dyn.dynamo_budget(client, database=DB, since="10m").errors >= 1
