"""A real ClickHouse server (HTTP + native TCP) from chdb-core, in a process of its own.

chdb's clickhouse-local opens the server listeners only for the duration of one full
`chdb._chdb.query(..., path=DATA_DIR)` call, reading ports and listen_host from `config.xml` in the
current directory (docs/contracts.md#embedded-clickhouse). So the server process writes that config, runs one statement that
starts the listeners and then sleeps for ever, and is stopped with SIGTERM. This relies on a private
chdb entry point: chdb-core is pinned exactly and this module is the only place that knows.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.common.exposure import is_loopback
from phaselens.common.ports import listens, port_in_use_error
from phaselens.common.process import BIND_ATTEMPTS, LOOPBACK, die_with_parent, free_port, port_in_use, terminate

_CONFIG = """<clickhouse>
  <listen_host>{host}</listen_host>
  <http_port>{http_port}</http_port>
  <tcp_port>{tcp_port}</tcp_port>
  <logger><level>warning</level><console>1</console></logger>
{extra}</clickhouse>
"""
# sleep() is capped at 3 s per block; one row per block keeps the statement alive ~95 years, and
# the filter keeps it from producing output. The HTTP interface inherits this statement's output
# format as its default, so it must be ClickHouse's usual HTTP default, TabSeparated.
_SERVE_SQL = (
    "SYSTEM START LISTEN HTTP; SYSTEM START LISTEN TCP; "
    "SELECT number FROM numbers(1000000000) WHERE sleep(3) != 0 "
    "SETTINGS max_block_size = 1, max_execution_time = 0"
)


class EmbeddedClickHouseError(RuntimeError):
    pass


def ping(url: str, timeout_s: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=timeout_s) as r:
            return r.read().strip() == b"Ok."
    except OSError:
        return False


def serve_forever(data_dir: str, http_port: int, tcp_port: int, host: str = LOOPBACK, extra_config: str = "") -> None:
    """Body of the server process: blocks until SIGTERM/SIGINT. `extra_config`: XML elements
    added inside `<clickhouse>` (a cluster definition, see storage/cluster.py)."""
    import chdb._chdb as chdb_native  # private entry point, see module docstring

    run_dir = Path(data_dir).resolve() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.xml").write_text(
        _CONFIG.format(host=host, http_port=http_port, tcp_port=tcp_port, extra=extra_config)
    )
    os.chdir(run_dir)
    db_path = str(Path(data_dir).resolve() / "db")
    # The statement blocks in C; it runs on a worker so that the main thread stays in Python and
    # can act on SIGTERM/SIGINT (Python signal handlers run only on the main thread).
    worker = threading.Thread(
        target=chdb_native.query,  # type: ignore[attr-defined]  # chdb's _chdb stub omits query()
        args=(_SERVE_SQL, "TabSeparated"),
        kwargs={"path": db_path},
        daemon=True,
    )
    worker.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))
    while worker.is_alive():
        worker.join(0.2)
    raise SystemExit("embedded ClickHouse statement ended unexpectedly")


@dataclass(slots=True)
class EmbeddedClickHouse:
    """Start/stop handle. `url` is what clickhouse-connect and every other part use."""

    data_dir: str
    http_port: int = 0
    tcp_port: int = 0
    host: str = LOOPBACK
    log_path: str | None = None
    extra_config: str = ""  # XML inside <clickhouse>, e.g. storage/cluster.py's cluster definition
    _proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def start(self, timeout_s: float = 30.0) -> Self:
        """Ports left at 0 are picked here, free when picked; another process may bind one before the
        server does, which then exits: such a start is retried on fresh ports (`BIND_ATTEMPTS` in all)."""
        if not is_loopback(self.host):  # the `default` user has no password
            raise EmbeddedClickHouseError(f"embedded ClickHouse listens on loopback only, not {self.host}")
        fixed = (self.http_port, self.tcp_port)
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or str(Path(self.data_dir) / "clickhouse.log")
        for attempt in range(1, BIND_ATTEMPTS + 1):
            self.http_port = fixed[0] or free_port(self.host)
            self.tcp_port = fixed[1] or free_port(self.host)
            taken = [port for port in (self.http_port, self.tcp_port) if port_in_use(port, self.host)]
            if any(port in fixed for port in taken):
                raise EmbeddedClickHouseError(str(port_in_use_error(self.host, taken[0], "embedded ClickHouse")))
            if not taken and self._spawn_and_wait(timeout_s, log_path):
                return self
            if attempt == BIND_ATTEMPTS or all(fixed) or self._proc is not None:
                break
        tail = Path(log_path).read_text(errors="replace")[-2000:] if Path(log_path).exists() else ""
        self.stop()
        raise EmbeddedClickHouseError(f"embedded ClickHouse did not answer /ping on {self.url}:\n{tail}")

    def _spawn_and_wait(self, timeout_s: float, log_path: str) -> bool:
        """True once it answers /ping; False (and nothing left running) when it exited first. A
        server that neither answers nor exits within `timeout_s` is kept in `_proc` for the caller."""
        cmd = [
            sys.executable,
            "-m",
            "phaselens.storage.embedded",
            self.data_dir,
            str(self.http_port),
            str(self.tcp_port),
            self.host,
            self.extra_config,
        ]
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                return False
            if ping(self.url) and self._listens():
                return True
            time.sleep(0.05)
        return False

    def _listens(self) -> bool:
        """Its own process listens on both ports: another server that took the HTTP port between the
        check and the bind would answer the ping while this one fails to bind and exits."""
        assert self._proc is not None
        return all(listens(self._proc.pid, port) for port in (self.http_port, self.tcp_port))

    @property
    def pid(self) -> int | None:
        """The server process (for CPU accounting in benchmarks); None when not started."""
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is not None:
            terminate(self._proc, timeout_s)
        self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    serve_forever(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
