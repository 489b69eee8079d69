"""Rotel (`pip install rotel`, the Rust OTel collector's `rotel-agent` binary) as a child process that
receives OTLP and writes into a ClickHouse with phaselens's schema (docs/collectors.md#rotel).

The flags are the ones docs/collectors.md tells a Rotel user to set: the ClickHouse exporter on
`<database>.otel_traces`, synchronous inserts (an acknowledged batch is in the table), and batching
off, because the packaged agent drops the resource (so `ServiceName` and `ResourceAttributes`) of
the part of an export request it splits to fill a batch (docs/collectors.md#why-rotel-writes-empty-servicenames).
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.common.process import BIND_ATTEMPTS, LOOPBACK, restartable_port, terminate


class RotelError(RuntimeError):
    pass


def agent_path() -> str:
    """The `rotel-agent` binary shipped inside the `rotel` wheel."""
    try:
        import rotel  # no py.typed: only its file location is used
    except ImportError:
        raise RotelError("Rotel is not installed: pip install rotel (it is in phaselens's test extra)") from None
    path = Path(rotel.__file__).parent / "rotel-agent"
    if not path.is_file():
        raise RotelError(f"the rotel package has no rotel-agent binary at {path}")
    return str(path)


@dataclass(slots=True)
class RotelAgent:
    """`with RotelAgent(clickhouse_url, database, log_path) as r:` export to `r.grpc_endpoint`."""

    clickhouse_url: str
    database: str
    log_path: str
    batching: bool = False  # True reproduces the resource loss on split (benchmarks measure it)
    grpc_port: int = 0
    http_port: int = 0
    extra_args: tuple[str, ...] = ()
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def grpc_endpoint(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def argv(self) -> list[str]:
        self.grpc_port = self.grpc_port or restartable_port(LOOPBACK)  # kept across restarts
        self.http_port = self.http_port or restartable_port(LOOPBACK)
        return [
            agent_path(),
            "start",
            "--otlp-grpc-endpoint", self.grpc_endpoint,
            "--otlp-http-endpoint", f"{LOOPBACK}:{self.http_port}",
            "--exporter", "clickhouse",
            "--clickhouse-exporter-endpoint", self.clickhouse_url,
            "--clickhouse-exporter-database", self.database,
            "--clickhouse-exporter-table-prefix", "otel",
            "--clickhouse-exporter-async-insert", "false",
            "--pid-file", f"{self.log_path}.pid",
            *(() if self.batching else ("--disable-batching",)),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        """Spawns at once (no waiting); `healthy()` says when it listens. The ports are kept across
        restarts."""
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start_serving(self, timeout_s: float = 20.0) -> Self:
        """start(), then wait until both receivers accept connections (RotelError with its log
        otherwise). Ports picked here were free when picked; another process may bind one before the
        agent does, which then exits: fresh ports are picked and it starts again (BIND_ATTEMPTS in all)."""
        picked = not (self.grpc_port or self.http_port)
        attempt = 1
        while (code := self._start_and_wait(timeout_s)) is not None:
            if not picked or attempt == BIND_ATTEMPTS:
                raise RotelError(f"rotel-agent exited with {code}:\n{self.log_tail()}")
            self.grpc_port = self.http_port = 0
            attempt += 1
        return self

    def _start_and_wait(self, timeout_s: float) -> int | None:
        """start(); None once it serves, its exit code if it exited first (RotelError if neither)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                return self.stop()
            if self.healthy():
                return None
            time.sleep(0.05)
        self.stop()
        raise RotelError(f"rotel-agent did not listen on {self.grpc_endpoint} within {timeout_s:.0f} s")

    def healthy(self) -> bool:
        return _accepts(self.grpc_port) and _accepts(self.http_port)

    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        path = Path(self.log_path)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, as a crash would (the fault scenarios)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (Rotel flushes what it holds), SIGKILL after `timeout_s`; the exit code."""
        code = terminate(self._proc, timeout_s) if self._proc is not None else None
        self._proc = None
        Path(f"{self.log_path}.pid").unlink(missing_ok=True)
        return code

    def __enter__(self) -> Self:
        return self.start_serving()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False
