"""Shared fixtures: one real embedded ClickHouse server for each worker's session (loopback only), and
how the suite is split between pytest-xdist's workers (pyproject's addopts: `-n 3 --dist loadgroup`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import clickhouse_connect
import pytest

from phaselens.collectors.schema import ident
from phaselens.storage.embedded import EmbeddedClickHouse

# fixtures that several modules share at session scope, registered here once (a fixture imported into
# two modules is two fixtures, each started once per module): the vLLMs and the stack pipeline
pytest_plugins = ("tests.vllm_fixtures", "tests.stack_fixtures", "tests.module_cpu")
_db_counter = itertools.count()
_session_servers: list[EmbeddedClickHouse] = []  # the session's server, once a test started it

# Units of work that take longest (wall time; `--module-cpu`, docs/development.md), sent to the workers
# first so that no worker is left alone with a long one at the end; the rest keep their collection order.
LONGEST_FIRST = (
    "test_harness_vllm",  # these three: one unit of work (SHARED_UNITS), in this order:
    "test_vllm",  # the shared vLLMs start in the first and serve the second,
    "test_vllm_pd",  # which stops them before starting its own two
    "test_diagnose",  # these four: one unit of work (SHARED_UNITS), tests/stack_fixtures.py's pipeline
    "test_budget_late_client",
    "test_budget_delivery",
    "test_budget_network",
    "test_cluster",
    "test_harness_import",
    "test_engine_process",
    "test_packaging",
    "test_rotel",
    "test_disagg_stack",
    "test_rollup_backfill",
    "test_rollup",
    "test_instrumentation_process",
    "test_demo_cluster",
    "test_demo",
    "test_faults",
    "test_sampling",
    "test_analysis",
    "test_dynamo",
)


# Modules that share a session-scoped server: one unit of work (so one worker) together.
SHARED_UNITS = {
    **dict.fromkeys(("test_harness_vllm", "test_vllm", "test_vllm_pd"), "vllm"),
    **dict.fromkeys(
        ("test_diagnose", "test_budget_late_client", "test_budget_delivery", "test_budget_network"), "stack"
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONGEST_FIRST` first, the rest in collection order (`--no-loadscope-reorder` keeps it)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` as this suite means it: each module one unit of work for xdist, so its
    module-scoped servers start once, on one worker; `SHARED_UNITS` several modules one unit. Read
    from the test ids here: pytest-xdist 3.8 groups by an `@group` suffix it writes into
    `Item._nodeid`, which pytest 9.2's `nodeid` no longer reads, so its `xdist_group` marks group
    nothing (every test was its own unit)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_UNITS.get(Path(path).stem, path)

    return ModuleScheduling(config, log)


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
            stop_running_views(client)


def stop_running_views(client) -> None:
    """`SYSTEM STOP VIEW` for every refreshable view of the server that still refreshes on its own."""
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
