"""Private helpers of the collector tests: a running Collector on a fresh database, row polling,
a `phaselens collector` process killed with SIGKILL and restarted over its spool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from phaselens.collectors import schema
from phaselens.collectors.service import Collector


def otel_env(endpoint: str, service: str) -> dict[str, str]:
    """This environment with a process's OTel SDK exporting traces alone to `endpoint` over gRPC,
    flushed every 200 ms (the SDK's 5 s default would make tests wait)."""
    return os.environ | {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


def wait_rows(ch_client, database: str, expected: int, timeout_s: float = 15.0, table: str = "otel_traces") -> int:
    """Polls until `expected` rows of `table` are visible (or the timeout); returns the last count."""
    deadline = time.monotonic() + timeout_s
    count = -1
    while time.monotonic() < deadline:
        count = int(ch_client.command(f"SELECT count() FROM {database}.{table}"))
        if count >= expected:
            return count
        time.sleep(0.05)
    return count


def rows(ch_client, database: str, order_by: str = "SpanName") -> list[dict]:
    return list(ch_client.query(f"SELECT * FROM {database}.otel_traces ORDER BY {order_by}").named_results())


@pytest.fixture()
def traces_db(ch_client, fresh_database) -> str:
    schema.apply(ch_client, schema.statements(fresh_database))
    return fresh_database


@pytest.fixture()
def collector(clickhouse, traces_db, tmp_path):
    c = Collector(
        clickhouse.url,
        database=traces_db,
        spool_dir=str(tmp_path / "spool"),
        flush_interval_s=0.05,
        max_body_bytes=1 << 20,
    ).start()
    yield c
    c.stop()


ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Endpoints:
    grpc: str  # host:port
    http: str  # http://host:port


def start_collector_process(url: str, database: str, spool: str, flush_s: str) -> tuple[subprocess.Popen, Endpoints]:
    """`phaselens collector` in a process of its own, once it prints READY."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "phaselens.commands.collector", "--clickhouse", url, "--database", database),
            *("--grpc-port", "0", "--http-port", "0", "--spool", spool, "--flush-interval", flush_s),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("READY collector grpc="), line
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    return proc, Endpoints(fields["grpc"], fields["http"])


@contextmanager
def killed_and_restarted(
    url: str, database: str, spool: str, before_kill: Callable[[Endpoints], None], flush_s: str = "0.05"
) -> Iterator[Endpoints]:
    """Runs `before_kill` against a collector process, SIGKILLs it, restarts it over the same spool
    and yields its endpoints; on leaving, it must stop cleanly on SIGTERM."""
    proc, endpoints = start_collector_process(url, database, spool, flush_s)
    try:
        before_kill(endpoints)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    proc, endpoints = start_collector_process(url, database, spool, "0.05")
    try:
        yield endpoints
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
