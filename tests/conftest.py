"""Shared fixtures: one real embedded ClickHouse server for the whole session (loopback only)."""

from __future__ import annotations

import itertools

import clickhouse_connect
import pytest

from phaselens.storage.embedded import EmbeddedClickHouse

_db_counter = itertools.count()


@pytest.fixture(scope="session")
def clickhouse(tmp_path_factory) -> EmbeddedClickHouse:
    """A running embedded ClickHouse 26.9 server; `.url`, `.http_port`, `.tcp_port`."""
    server = EmbeddedClickHouse(str(tmp_path_factory.mktemp("clickhouse"))).start()
    yield server
    server.stop()


@pytest.fixture()
def ch_client(clickhouse):
    client = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
    yield client
    client.close()


@pytest.fixture()
def fresh_database(ch_client) -> str:
    """A database name no other test uses (the schema tools create it)."""
    name = f"test_{next(_db_counter)}"
    ch_client.command(f"DROP DATABASE IF EXISTS {name}")
    return name
