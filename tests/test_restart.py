"""Restart at once: a listener whose previous owner was SIGKILLed with live connections rebinds
immediately; a port held by a live process still fails, naming the process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from phaselens.collectors.grpc_receiver import GrpcBindError, start_grpc
from phaselens.collectors.http_receiver import HttpReceiver
from phaselens.collectors.ingest import Ingest
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.service import Collector
from phaselens.collectors.spool import Spool
from phaselens.common import process
from phaselens.common.ports import PortInUse, bind_reusable
from phaselens.common.process import LOOPBACK, free_port, restartable_port
from phaselens.faults.load import Ledger, SpanLoad
from phaselens.faults.parts import CollectorProcess, wait_until
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.embedded import EmbeddedClickHouse, EmbeddedClickHouseError
from tests.collector_fixtures import traces_db
from tests.collector_payloads import export_request
from tests.restart_bounds import restart_bound_s

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# a child that listens on argv[1] and holds one accepted connection open
_HOLDER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('ready', flush=True)\n"
    "c, _ = s.accept(); c.recv(1); time.sleep(120)\n"
)


def _holder(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _idle_clients(port: int, stop: threading.Event, count: int = 4) -> list[threading.Thread]:
    """Keep-alive clients as an exporter's pool holds them: one request, then idle, reading; when the
    server goes away they see EOF and close, which leaves the server's side in TIME_WAIT (what made a
    restart fail with EADDRINUSE for a minute). They reconnect until `stop`."""

    def client() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((LOOPBACK, port), timeout=1) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    sock.settimeout(None)
                    while sock.recv(4096):  # the response, then EOF when the server dies
                        pass
            except OSError:
                stop.wait(0.05)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _stored(ch_client, database: str, service: str) -> tuple[set[str], int]:
    rows = ch_client.query(
        "SELECT SpanId, count() FROM {db:Identifier}.otel_traces WHERE ServiceName = {s:String} GROUP BY SpanId",
        parameters={"db": database, "s": service},
    ).result_rows
    return {r[0] for r in rows}, sum(int(r[1]) for r in rows)


def _kill_and_restart_under_load(collector: CollectorProcess, bound_s: float) -> Ledger:
    """SIGKILL under SDK load and idle keep-alive clients, restart at once, serving again within
    `bound_s`; the load's ledger once 2,000 more spans were acknowledged after the restart."""
    load = SpanLoad(collector.grpc_endpoint, "restart-test", spans_per_s=2000).start()
    stop_idle = threading.Event()
    _idle_clients(collector.http_port, stop_idle)
    try:
        assert wait_until(lambda: len(load.ledger.acknowledged) >= 2000, 30) is not None
        collector.kill()
        killed = time.monotonic()
        collector.start()  # at once, same ports, same spool
        assert wait_until(collector.healthy, bound_s) is not None, collector.log_tail()
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            channel.unary_unary(EXPORT)(
                export_request(4, time.time_ns(), service="restart-probe").SerializeToString(), timeout=5
            )
        assert time.monotonic() - killed < bound_s
        acked_at_restart = len(load.ledger.acknowledged)
        assert wait_until(lambda: len(load.ledger.acknowledged) >= acked_at_restart + 2000, 30) is not None
    finally:
        stop_idle.set()
        ledger = load.stop()
    return ledger


def test_collector_sigkilled_under_load_serves_again_at_once_losing_and_duplicating_nothing(
    clickhouse, ch_client, traces_db, tmp_path
):
    collector = CollectorProcess(
        clickhouse.url, str(tmp_path / "spool"), str(tmp_path / "collector.log"), database=traces_db
    )
    started = time.monotonic()
    collector.start_serving()
    cold_start_s = time.monotonic() - started
    try:
        ledger = _kill_and_restart_under_load(collector, restart_bound_s(cold_start_s, 5.0))
        assert collector.exit_code() is None, collector.log_tail()  # the restart did not fail to bind
        assert (
            wait_until(lambda: ledger.acknowledged <= _stored(ch_client, traces_db, "restart-test")[0], 60) is not None
        )
    finally:
        collector.stop()  # a failed assertion must not leave it holding its ports and spool
    ids, rows = _stored(ch_client, traces_db, "restart-test")
    assert ledger.acknowledged <= ids  # nothing acknowledged lost
    assert rows == len(ids)  # no duplicates
    assert ledger.client_dropped() == 0


def test_a_listener_rebinds_at_once_after_its_owner_was_killed_with_a_connection_open():
    port = free_port()
    holder = _holder(port)
    client = socket.create_connection((LOOPBACK, port))
    client.send(b"x")
    time.sleep(0.2)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    client.close()  # both sides closed: the listener's side of the connection is left in TIME_WAIT
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind((LOOPBACK, port))  # the failure of issue: without SO_REUSEADDR the port stays taken
    with socket.socket() as sock:
        bind_reusable(sock, LOOPBACK, port, "test")
        sock.listen()


def test_a_port_held_by_a_live_process_fails_naming_that_process(tmp_path):
    port = free_port()
    holder = _holder(port)
    spool = Spool(str(tmp_path / "spool"))
    try:
        ingest = Ingest(spool, CollectorMetrics())
        with pytest.raises(PortInUse, match=rf"OTLP/HTTP on 127.0.0.1:{port}: .*pid {holder.pid} \(.*python"):
            HttpReceiver([ingest], lambda: "", LOOPBACK, port)
        with pytest.raises(GrpcBindError, match=rf"OTLP/gRPC on 127.0.0.1:{port}: .*pid {holder.pid}"):
            start_grpc([ingest], LOOPBACK, port)
        with pytest.raises(EmbeddedClickHouseError, match=rf"pid {holder.pid}"):
            EmbeddedClickHouse(str(tmp_path / "ch"), http_port=port).start()
    finally:
        spool.close()
        holder.kill()
        holder.wait()


def test_a_grpc_bind_that_fails_for_another_reason_does_not_blame_a_taken_port(tmp_path):
    spool = Spool(str(tmp_path / "spool"))
    try:
        with pytest.raises(GrpcBindError, match=r"OTLP/gRPC on 256\.0\.0\.1:\d+: ") as failure:
            start_grpc([Ingest(spool, CollectorMetrics())], "256.0.0.1", free_port())  # not an address
        assert "in use" not in str(failure.value)
    finally:
        spool.close()


def test_embedded_clickhouse_restarts_on_its_ports_at_once_after_sigkill(tmp_path):
    started = time.monotonic()
    server = EmbeddedClickHouse(str(tmp_path / "ch"), restartable_port(), restartable_port()).start()
    cold_start_s = time.monotonic() - started
    client = connect(server.url)
    client.command("CREATE TABLE t (x UInt8) ENGINE = MergeTree ORDER BY x")
    client.command("INSERT INTO t VALUES (1)")  # the connection stays open (keep-alive)
    os.kill(server.pid, signal.SIGKILL)
    server.stop()  # reaps it
    started = time.monotonic()
    again = EmbeddedClickHouse(str(tmp_path / "ch"), http_port=server.http_port, tcp_port=server.tcp_port).start()
    try:
        assert time.monotonic() - started < restart_bound_s(cold_start_s, 15.0)
        assert int(connect(again.url).command("SELECT count() FROM t")) == 1
    finally:
        again.stop()


def test_a_large_spool_replays_behind_the_listeners(clickhouse, ch_client, traces_db, tmp_path):
    """~100 MB of backlog: the restarted collector answers and accepts exports while the replay is
    still under way (its listeners do not wait for the backlog)."""
    spool = Spool(str(tmp_path / "spool"))
    body = export_request(1000, time.time_ns(), service="backlog").SerializeToString()
    records = (100 << 20) // len(body)
    for _ in range(records):
        spool.append(body, 1000)
    spool.close()
    started = time.monotonic()
    collector = Collector(clickhouse.url, database=traces_db, spool_dir=str(tmp_path / "spool")).start()
    try:
        with urllib.request.urlopen(f"{collector.http_endpoint}/health", timeout=5) as r:
            assert r.status == 200
        with grpc.insecure_channel(collector.grpc_endpoint) as channel:
            channel.unary_unary(EXPORT)(
                export_request(4, time.time_ns(), service="fresh").SerializeToString(), timeout=5
            )
        serving_s = time.monotonic() - started
        written = collector.metrics.snapshot()["spans_written"]
    finally:
        collector.stop(drain_timeout_s=1)  # what is not written stays spooled
    # "At once" as this test can tell it: serving began before the replay ended (serving_s < the
    # replay's duration), i.e. fewer spans written than spooled. A wall-clock bound here would only
    # say how loaded the machine was (here 0.26 s to serve, 0 of 268,000 spans written by then).
    assert written < records * 1000, f"served after {serving_s:.2f} s, when the replay had finished"


def test_a_restartable_port_lies_below_the_ephemeral_range_and_binds(monkeypatch):
    """Outgoing connections take their local ports from the ephemeral range: a server restarted on a
    port below it cannot lose the port to one while it is down."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [restartable_port() for _ in range(20)]
    assert all(20000 <= port < low for port in ports), (ports, low)
    assert len(set(ports)) > 1  # drawn, not one fixed port every process would want
    for port in ports:
        with socket.socket() as s:
            bind_reusable(s, LOOPBACK, port, "test")
    # no room below the range: a port the OS picks, as free_port gives
    monkeypatch.setattr(process, "_ephemeral_low", lambda: 20500)
    assert restartable_port() >= low
