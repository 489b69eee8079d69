"""The whole pipeline on one machine: embedded ClickHouse (one node, or a cluster of `shards`
nodes: phaselens/stack_storage.py), schema, collector, reference server.

Each long-running part is a child process speaking the `READY <what> <url>` line protocol
(docs/contracts.md#process-line-protocol). Children are started in a session of their own (a
terminal's Ctrl-C reaches only the orchestrator, which then stops them in order) and with
PR_SET_PDEATHSIG, so that they die with the orchestrator even when it is SIGKILLed. Stop order is the
data-flow order: server (flushes its spans to the collector), collector (drains its spool into
ClickHouse), ClickHouse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.analysis.schema import FACTS_VIEW, SPANS_VIEW
from phaselens.common.process import LOOPBACK, die_with_parent, terminate
from phaselens.instrumentation import names
from phaselens.stack_storage import ShardedCluster, SingleNode, make_storage
from phaselens.storage.clickhouse_url import connect

SERVER_SERVICE = names.SERVER_SERVICE_NAME
VLLM_SERVICE = names.VLLM_SERVICE_NAME
CLIENT_SERVICE = "phaselens-loadgen"
# Spans reach the collector within ~0.2 s instead of the SDK's default 5 s batch delay.
BSP_SCHEDULE_DELAY_MS = "200"
SERVER_KINDS = ("reference", "vllm", "vllm-native")
VLLM_MAX_MODEL_LEN = 2048  # the demo's longest prompts are ~1,000 tokens of the tiny byte-level vocabulary


class StackError(RuntimeError):
    pass


def project_env() -> dict[str, str]:
    """Environment for children: unbuffered output for the READY line. `phaselens` is importable
    as installed; no PYTHONPATH edit (it would let a folder in the working directory shadow ours)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass(slots=True)
class Child:
    """A child process whose stdout and stderr go to `log_path`."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where this run's output starts in the log (a restart appends to it)
    url: str = ""
    ready_line: str = ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the child printed `READY <what> <url>`; returns the url."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self._output().splitlines():
                if line.startswith("READY "):
                    self.ready_line = line
                    self.url = line.split()[-1].rpartition("=")[2]  # `READY x URL` or `READY x k=URL`
                    return self.url
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise StackError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _output(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
        return terminate(self.proc, timeout_s)


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str], stderr=subprocess.STDOUT) -> Child:
    """Start `python -m phaselens <argv>` in its own session, dying with us; stdout to the log
    `<log_dir>/<name>.log` (`stderr` too unless another target is given, e.g. None for the terminal)."""
    return spawn_logged(name, [sys.executable, "-m", "phaselens", *argv], log_dir / f"{name}.log", env, stderr)


def spawn_logged(name: str, argv: list[str], log_path: Path, env: dict[str, str], stderr=subprocess.STDOUT) -> Child:
    """Start `argv` in its own session, dying with us, its output appended to `log_path`."""
    parent = os.getpid()
    with open(log_path, "ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(parent),
        )
    return Child(name, proc, log_path, offset)


def collector_flags(
    clickhouse_url: str, database: str, spool: str, grpc_port: int = 0, http_port: int = 0
) -> list[str]:
    """`phaselens collector` flags; port 0 lets the OS pick a free port as the collector binds it
    (picking one first and binding it later races other processes), named on its READY line."""
    return [
        "--clickhouse",
        clickhouse_url,
        "--database",
        database,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--spool",
        spool,
    ]


def spawn_collector(flags: list[str], log_path: Path) -> Child:
    """`phaselens collector <flags>` as `python -m phaselens.commands.collector`: that command alone,
    without importing every other command module, so it is READY in well under a second."""
    argv = [sys.executable, "-m", "phaselens.commands.collector", *flags]
    return spawn_logged("collector", argv, log_path, project_env())


def collector_ports(ready_line: str) -> tuple[int, int]:
    """(gRPC port, HTTP port) from `READY collector grpc=HOST:PORT http=URL`."""
    fields = dict(f.split("=", 1) for f in ready_line.split()[2:])
    return int(fields["grpc"].rpartition(":")[2]), int(fields["http"].rpartition(":")[2])


@dataclass(slots=True)
class Stack:
    """ClickHouse + schema + collector + reference server; `with Stack(dir) as s:` or start()/stop().

    `shards` > 1: ClickHouse is an embedded cluster of that many shards, the collector writes to it
    with `--cluster`; everything else reads through `clickhouse_url` as with one node.
    `otel_env(service)` is the environment a traced client needs to export to this stack.
    """

    data_dir: str
    model: str = "tiny"
    device: str = "cpu"
    database: str = "otel"
    server_args: tuple[str, ...] = ()
    server_kind: str = "reference"  # SERVER_KINDS: the reference server, or a real vLLM (with or without the plugin)
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    shards: int = 1
    storage: SingleNode | ShardedCluster | None = field(default=None, init=False)
    collector: Child | None = field(default=None, init=False)
    server: Child | None = field(default=None, init=False)
    grpc_port: int = field(default=0, init=False)
    http_port: int = field(default=0, init=False)
    collector_argv: list[str] = field(default_factory=list, init=False)  # `phaselens <argv>`, to print

    @property
    def clickhouse_url(self) -> str:
        return self.storage.url if self.storage else ""

    @property
    def server_url(self) -> str:
        return self.server.url if self.server else ""

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.grpc_port}"

    @property
    def otlp_http_traces_endpoint(self) -> str:
        """The collector's OTLP/HTTP traces URL, as a signal-specific endpoint is used: whole."""
        return f"http://{LOOPBACK}:{self.http_port}/v1/traces"

    @property
    def log_dir(self) -> Path:
        return Path(self.data_dir) / "logs"

    def start(self, on_phase=lambda phase: None) -> Self:
        """Bring every part up; `on_phase(name)` is called before each step (for progress display)."""
        try:
            self._start_storage(on_phase)
            # The server exports to the port the collector names when READY, so it starts after.
            on_phase("collector and server")
            self._start_collector()
            self._spawn_server()
            assert self.server is not None  # spawned just above
            self.server.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_pipeline(self, on_phase=lambda phase: None) -> Self:
        """ClickHouse, schema and collector only: for a server started elsewhere (a real vLLM)."""
        try:
            self._start_storage(on_phase)
            on_phase("collector")
            self._start_collector()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_storage(self, on_phase) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.storage is None:  # one set before the start is already running (a test session's)
            on_phase("clickhouse")
            self.storage = make_storage(Path(self.data_dir), self.log_dir, self.shards)
            self.storage.start()
        on_phase("schema")
        self.apply_schema()

    def apply_schema(self) -> None:
        """The collector's tables first, then the analysis views (docs/contracts.md), on every node."""
        assert self.storage is not None, "start the storage first"
        self.storage.apply_schema(self.database)

    def client(self):
        """A clickhouse-connect client of this stack's ClickHouse (close it, or use `with`)."""
        return connect(self.clickhouse_url)

    def _start_collector(self) -> None:
        """Spawn the collector on ports the OS picks and wait until it names them."""
        assert self.storage is not None  # started before the collector
        spool, storage_flags = str(Path(self.data_dir) / "spool"), self.storage.collector_flags
        flags = collector_flags(self.clickhouse_url, self.database, spool)
        self.collector = spawn_collector([*flags, *storage_flags], self.log_dir / "collector.log")
        self.collector.wait_ready(self.ready_timeout_s)
        self.grpc_port, self.http_port = collector_ports(self.collector.ready_line)
        ports = (self.grpc_port, self.http_port)
        self.collector_argv = ["collector", *collector_flags(self.clickhouse_url, self.database, spool, *ports)]
        self.collector_argv += storage_flags

    def _spawn_server(self) -> None:
        if self.server_kind != "reference":
            self.server = server = self._vllm_server()  # set first: stop() ends it if spawn fails
            server.spawn()
            return
        argv = ["serve", "--model", self.model, "--device", self.device, "--port", "0", *self.server_args]
        self.server = spawn("server", argv, self.log_dir, self.otel_env(SERVER_SERVICE))

    def _vllm_server(self):
        """A real vLLM on the tiny model (saved into the data directory), tracing to this collector:
        with the phaselens plugin ("vllm") or with its native spans only ("vllm-native")."""
        from phaselens.integrations.vllm.delivery import MIDDLEWARE_PATH
        from phaselens.integrations.vllm.launcher import VllmServer, default_python, trace_export
        from phaselens.integrations.vllm.tiny_model import save_tiny_llama

        python = default_python()
        if python is None:
            raise StackError("no vLLM found: run ./setup.sh --vllm, or set PHASELENS_VLLM_PYTHON to a python with vLLM")
        model_dir = save_tiny_llama(Path(self.data_dir) / "tiny-llama")
        env = {k: v for k, v in self.otel_env(VLLM_SERVICE).items() if k.startswith("OTEL_")}
        env["VLLM_PLUGINS"] = "phaselens" if self.server_kind == "vllm" else ""
        endpoint, protocol = trace_export(
            self.otlp_grpc_endpoint, self.otlp_http_traces_endpoint, self.server_kind == "vllm"
        )
        return VllmServer(
            python,
            model_dir,
            self.log_dir / "server.log",
            env=env,
            served_name=self.model,
            max_model_len=VLLM_MAX_MODEL_LEN,
            middleware=(MIDDLEWARE_PATH,) if self.server_kind == "vllm" else (),
            otlp_endpoint=endpoint,
            otlp_protocol=protocol,
        )

    def served_model(self) -> str:
        """The model name the server answers to (`tiny`, or a local model folder's base name)."""
        with urllib.request.urlopen(f"{self.server_url}/v1/models", timeout=10) as r:
            return json.load(r)["data"][0]["id"]

    def otel_env(self, service_name: str) -> dict[str, str]:
        """Standard OTEL_* variables pointing at this stack's collector (OTLP/gRPC: traces and metrics)."""
        env = project_env()
        env.update(
            {
                "OTEL_SERVICE_NAME": service_name,
                "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_grpc_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_TRACES_EXPORTER": "otlp",
                # the collector stores metrics (otel_metrics_*): the gen_ai.server.* histograms land beside the spans
                "OTEL_METRICS_EXPORTER": "otlp",
                # phaselens's processes wire no OTel log exporter (instrumentation/pipeline/otel_setup.py)
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_TRACES_SAMPLER": "parentbased_always_on",
                "OTEL_BSP_SCHEDULE_DELAY": BSP_SCHEDULE_DELAY_MS,
            }
        )
        return env

    def bench(self, argv: list[str], timeout_s: float, url: str | None = None) -> int:
        """Run `phaselens bench --url <server, or url> <argv>` with client spans exported to this stack;
        its progress bar (stderr) shows on the terminal, its tables go to logs/bench.log."""
        child = spawn(
            "bench",
            ["bench", "--url", url or self.server_url, *argv],
            self.log_dir,
            self.otel_env(CLIENT_SERVICE),
            stderr=None,
        )
        try:
            return child.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise StackError(f"bench did not finish in {timeout_s:.0f} s:\n{child.log_tail()}") from None
        finally:
            child.stop(self.stop_timeout_s)

    def requests_present(self, trace_ids: list[str]) -> int:
        """How many of `trace_ids` are queryable with both a client and a server view."""
        sql = (
            f"SELECT countIf(has_client AND has_server) FROM {{db:Identifier}}.{FACTS_VIEW} "
            "WHERE trace_id IN {ids:Array(String)}"
        )
        with self.client() as client:
            return int(client.query(sql, parameters={"db": self.database, "ids": trace_ids}).result_rows[0][0])

    def span_rows(self) -> int:
        """Spans stored, on every shard (to see when ingestion has gone quiet)."""
        sql = f"SELECT count() FROM {{db:Identifier}}.{SPANS_VIEW}"
        with self.client() as client:
            return int(client.query(sql, parameters={"db": self.database}).result_rows[0][0])

    def stop(self) -> dict[str, int]:
        """Stop every part that runs, in data-flow order; returns exit codes by part name."""
        codes = {}
        for attr in ("server", "collector"):
            child = getattr(self, attr)
            if child is not None:
                codes[attr] = child.stop(self.stop_timeout_s)
                setattr(self, attr, None)
        if self.storage is not None:
            self.storage.stop(self.stop_timeout_s)
            self.storage = None
            codes["clickhouse"] = 0
        return codes

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(slots=True)
class ServedStack:
    """The stack's pipeline (ClickHouse, schema, collector) with servers started outside `Stack`:
    a subclass starts and stops them (`start_servers`, `stop_servers`). Pipeline first, servers
    after; stop order is the data-flow order: servers (each flushes its spans), then the pipeline."""

    stack: Stack

    def start(self, on_phase=lambda phase: None) -> Self:
        try:
            self.stack.start_pipeline(on_phase)
            self.start_servers(on_phase)
        except BaseException:
            self.stop()
            raise
        return self

    def start_servers(self, on_phase=lambda phase: None) -> Self:
        raise NotImplementedError

    def stop_servers(self) -> dict[str, int]:
        raise NotImplementedError

    def stop(self) -> dict[str, int]:
        return self.stop_servers() | self.stack.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
