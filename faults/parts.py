"""The parts a fault scenario breaks: the collector as a process of its own (SIGKILL-able, restarted on
the same ports and spool), and a loopback link that delays what goes through it."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from phaselens.common.process import LOOPBACK, restartable_port
from phaselens.stack import Child, StackError, collector_flags, collector_ports, spawn_collector


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> float | None:
    """Seconds until `predicate()` held, or None after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval_s)
    return None


def collector_counters(http_port: int) -> dict[str, int]:
    """A phaselens collector's /metrics by name, less the `phaselens_collector_` prefix and any
    `_total` suffix ({} when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{http_port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {
        m[1]: int(float(m[2]))
        for m in re.finditer(r"^phaselens_collector_(\w+?)(?:_total)? ([\d.e+]+)$", text, re.MULTILINE)
    }


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass(slots=True)
class CollectorProcess:
    """`python -m phaselens.commands.collector` on a fixed spool, on ports picked at the first start
    below the ephemeral range (`restartable_port`: no outgoing connection takes one while it is
    down) and kept for every restart."""

    clickhouse_url: str
    spool_dir: str
    log_path: str
    database: str = "otel"
    max_spool_bytes: int = 1 << 30
    grpc_port: int = 0
    http_port: int = 0
    _child: Child | None = field(default=None, init=False)

    @property
    def grpc_endpoint(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    def healthy(self) -> bool:
        return bool(self.http_port) and http_ok(f"http://{LOOPBACK}:{self.http_port}/health")

    def start(self) -> None:
        """Spawns at once (no waiting); `healthy()` says when it serves."""
        self.grpc_port = self.grpc_port or restartable_port()
        self.http_port = self.http_port or restartable_port()
        flags = collector_flags(self.clickhouse_url, self.database, self.spool_dir, self.grpc_port, self.http_port)
        flags += ["--max-spool-bytes", str(self.max_spool_bytes), "--flush-interval", "0.1"]
        self._child = spawn_collector(flags, Path(self.log_path))

    def start_serving(self, timeout_s: float = 30.0) -> None:
        """start(), then wait until it is READY and take its ports (RuntimeError with its log otherwise)."""
        self.start()
        assert self._child is not None  # spawned just above
        try:
            self._child.wait_ready(timeout_s)
        except StackError as exc:
            self.stop(5.0)  # not left holding its ports and spool
            raise RuntimeError(f"collector did not start: {exc}") from None
        self.grpc_port, self.http_port = collector_ports(self._child.ready_line)

    def exit_code(self) -> int | None:
        return self._child.proc.poll() if self._child is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        return self._child.log_tail(chars) if self._child is not None else ""

    def kill(self) -> None:
        assert self._child is not None  # started
        self._child.proc.send_signal(signal.SIGKILL)
        self._child.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._child is not None:
            self._child.stop(timeout_s)


@dataclass(slots=True)
class SlowLink:
    """Loopback TCP forwarder that holds every chunk going upstream for `delay_s` (0: none): a stand-in
    for a slow ClickHouse (the real one cannot be slowed on purpose here), named as such in reports."""

    upstream_port: int
    delay_s: float = 0.0
    port: int = 0
    _listener: socket.socket | None = field(default=None, init=False)
    _closed: threading.Event = field(default_factory=threading.Event, init=False)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> SlowLink:
        self._listener = socket.create_server((LOOPBACK, self.port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="slow-link", daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._listener is not None  # start() made it before this thread
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((LOOPBACK, self.upstream_port))
            except OSError:
                client.close()
                continue
            for src, dst, delayed in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, delayed), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if delayed:
                    self._hold()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:  # one side ended: end both (the other pump then ends too)
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            src.close()

    def _hold(self) -> None:
        """Waits `delay_s`, cut short when the delay is lowered meanwhile (the slowness ends)."""
        started = time.monotonic()
        while not self._closed.is_set() and time.monotonic() - started < self.delay_s:
            time.sleep(0.02)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
