"""The embedded ClickHouse server: real HTTP interface, persistence, clean stop, port conflicts."""

import http.server
import socket
import threading
from pathlib import Path

import clickhouse_connect
import pytest

from phaselens.common.process import free_port
from phaselens.storage import embedded
from phaselens.storage.embedded import EmbeddedClickHouse, EmbeddedClickHouseError, ping


def test_serves_sql_over_http(ch_client):
    assert ch_client.query("SELECT version()").result_rows[0][0].startswith("26.9")


def test_data_persists_across_restart_and_stop_is_clean(tmp_path):
    server = EmbeddedClickHouse(str(tmp_path)).start()
    client = clickhouse_connect.get_client(host=server.host, port=server.http_port)
    client.command("CREATE TABLE t (x UInt64) ENGINE = MergeTree ORDER BY x")
    client.insert("t", [[1], [2], [3]], column_names=["x"])
    url = server.url
    server.stop()
    assert not server.running() and not ping(url)
    server = EmbeddedClickHouse(str(tmp_path)).start()
    client = clickhouse_connect.get_client(host=server.host, port=server.http_port)
    assert client.query("SELECT sum(x) FROM t").result_rows == [(6,)]
    server.stop()


def test_port_taken_fails_loudly(clickhouse, tmp_path):
    with pytest.raises(
        EmbeddedClickHouseError, match=rf"{clickhouse.http_port}: the port is in use by pid {clickhouse.pid} "
    ):
        EmbeddedClickHouse(str(tmp_path), http_port=clickhouse.http_port).start()


def test_refuses_a_non_loopback_address(tmp_path):
    with pytest.raises(EmbeddedClickHouseError, match="loopback only"):
        EmbeddedClickHouse(str(tmp_path), host="0.0.0.0").start()


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, monkeypatch):
    """The race between picking a free port and the server binding it, made certain: the first HTTP
    port picked is already bound by another socket (not listening, so no check before the spawn sees
    it). The server fails to bind it and exits; the start picks fresh ports and serves."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(embedded, "free_port", lambda host: next(picks, 0) or free_port(host))
        server = EmbeddedClickHouse(str(tmp_path)).start()
        try:
            assert server.http_port != taken and ping(server.url)
            assert "Address already in use" in (Path(tmp_path) / "clickhouse.log").read_text()
        finally:
            server.stop()


def test_a_ping_answered_by_another_server_on_its_port_is_not_its_start(tmp_path, monkeypatch):
    """The same race the other way: another server that answers /ping took the first HTTP port
    picked after the check before the spawn (made certain: the check finds every port free). The
    server fails to bind it and exits; the start does not take the other's answer for its own, and
    serves on fresh ports."""

    class Pong(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Ok.\n")

        def log_message(self, *args) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pong)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    picks = iter([taken])
    monkeypatch.setattr(embedded, "free_port", lambda host: next(picks, 0) or free_port(host))
    monkeypatch.setattr(embedded, "port_in_use", lambda port, host: False)
    try:
        server = EmbeddedClickHouse(str(tmp_path)).start()
        try:
            assert server.http_port != taken
            assert clickhouse_connect.get_client(host="127.0.0.1", port=server.http_port).command("SELECT 1") == 1
        finally:
            server.stop()
    finally:
        other.shutdown()
        other.server_close()
