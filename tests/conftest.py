"""Shared fixtures: one real embedded ClickHouse server for the whole session (loopback only)."""

from __future__ import annotations

import itertools

import clickhouse_connect
import pytest

from phaselens.collectors.schema import ident
from phaselens.storage.embedded import EmbeddedClickHouse

# the session's shared vLLMs: one fixture definition for every module (a fixture imported into two
# test modules would be two definitions, each with its own session instance)
pytest_plugins = ["tests.vllm_fixtures"]
_db_counter = itertools.count()
_session_servers: list[EmbeddedClickHouse] = []  # the session's server, once a test started it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A serial run keeps each xdist_group's tests together, where its first test is (as `-n` runs a
    group on one worker): a group's shared servers (tests/vllm_fixtures.py) then live only while
    their tests run, not idle through the modules between."""
    first: dict[str, int] = {}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        i, item = indexed
        mark = item.get_closest_marker("xdist_group")
        return (first.setdefault(mark.args[0], i) if mark else i), i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


@pytest.fixture(scope="session")
def clickhouse(tmp_path_factory) -> EmbeddedClickHouse:
    """A running embedded ClickHouse 26.9 server; `.url`, `.http_port`, `.tcp_port`."""
    server = EmbeddedClickHouse(str(tmp_path_factory.mktemp("clickhouse"))).start()
    _session_servers.append(server)
    yield server
    _session_servers.remove(server)
    server.stop()


@pytest.fixture(scope="module", autouse=True)
def _refreshes_stopped_after_the_module():
    """After each module, every refreshable view still refreshing in the session's server is stopped:
    a database made with `schema apply` refreshes its live rollup every 10 s and seals every 30 s (about
    a second of ClickHouse CPU each) for the rest of the session, though no later module reads it."""
    yield
    for server in _session_servers:
        with clickhouse_connect.get_client(host=server.host, port=server.http_port) as client:
            running = client.query("SELECT database, view FROM system.view_refreshes WHERE status != 'Disabled'")
            for database, view in running.result_rows:
                client.command(f"SYSTEM STOP VIEW {ident(database)}.{ident(view)}")


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
