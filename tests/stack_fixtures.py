"""One stack pipeline for the test session (registered in tests/conftest.py): the session's ClickHouse, the schema in a database of its
own, and a `phaselens collector` process. The modules that use it are one unit of work
for xdist (`SHARED_UNITS` in tests/conftest.py: they run on the worker that started it), start their own
reference servers with service names (or trace ids) no other module uses, and wait with
`wait_stored` until their spans are in ClickHouse instead of stopping the collector to drain it."""

from __future__ import annotations

from pathlib import Path

import pytest

from phaselens.faults.parts import collector_counters, wait_until
from phaselens.stack import Child, Stack, spawn
from phaselens.stack_storage import SingleNode


@pytest.fixture(scope="session")
def pipeline(clickhouse, tmp_path_factory) -> Stack:
    """ClickHouse (the session's, left running), schema (database `stack`) and collector."""
    data_dir = tmp_path_factory.mktemp("stack")
    stack = Stack(str(data_dir), database="stack")
    stack.storage = SingleNode(Path(data_dir), stack.log_dir)
    stack.storage.server = clickhouse
    stack.start_pipeline()
    yield stack
    stack.storage = None  # the session's fixture stops it
    stack.stop()


def serve(stack: Stack, name: str, service: str, *server_args: str) -> Child:
    """A reference server on the tiny model exporting as `service`; its log `<name>.log`."""
    argv = ["serve", "--model", "tiny", "--port", "0", *server_args]
    return spawn(name, argv, stack.log_dir, stack.otel_env(service))


def _drained(stack: Stack) -> bool:
    """Every span and metric point the collector accepted is in ClickHouse (its spool is empty)."""
    count = collector_counters(stack.http_port)
    return (
        bool(count)
        and count["spool_bytes"] == 0
        and all(count[f"{item}_received"] == count[f"{item}_written"] for item in ("spans", "metric_points"))
    )


def wait_stored(stack: Stack, timeout_s: float = 60.0) -> None:
    """Wait until what the collector accepted is stored: call it once the servers that exported were
    stopped (each flushes its spans on SIGTERM) and the clients exited (they flush on exit)."""
    assert wait_until(lambda: _drained(stack), timeout_s, interval_s=0.1) is not None, stack.collector.log_tail()
