"""The embedded ClickHouse server: real HTTP interface, persistence, clean stop, port conflicts."""

import clickhouse_connect
import pytest

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
