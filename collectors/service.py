"""The collector as one object: spool + writer + OTLP/gRPC + OTLP/HTTP receivers, start/stop.

with Collector(clickhouse_url="http://127.0.0.1:8123", spool_dir="/tmp/spool") as c:
    ...  # export to c.grpc_endpoint (host:port) or c.http_endpoint + "/v1/traces"
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Self

import grpc

from phaselens.collectors.grpc_receiver import start_grpc
from phaselens.collectors.http_receiver import HttpReceiver
from phaselens.collectors.ingest import Ingest
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.shard_sink import make_sink
from phaselens.collectors.spool import Spool
from phaselens.collectors.writer import SpoolWriter
from phaselens.common.exposure import check_exposure
from phaselens.common.tls import ServerTls


def default_spool_dir(grpc_port: int) -> str:
    """Where the CLI keeps its spool when none is given: persistent, so a restart replays it."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "phaselens", f"collector-spool-{grpc_port}")


@dataclass(slots=True)
class Collector:
    clickhouse_url: str
    database: str = "otel"
    cluster: str | None = None  # a ClickHouse cluster: rows sharded by trace id (collectors/shard_sink.py)
    cluster_insert: str = "direct"  # or "distributed": through the cluster's Distributed table
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 0
    spool_dir: str | None = None
    auth_token: str | None = None
    insecure: bool = False
    tls: ServerTls | None = None  # both receivers over TLS (mutual with a client CA)
    clickhouse_ca: str | None = None  # CA bundle for an https:// ClickHouse (None: the system's)
    max_spool_bytes: int = 1 << 30
    max_body_bytes: int = 16 << 20
    batch_spans: int = 50_000
    flush_interval_s: float = 0.2
    metrics: CollectorMetrics = field(default_factory=CollectorMetrics)
    _spool: Spool | None = field(default=None, init=False)
    _writer: SpoolWriter | None = field(default=None, init=False)
    _grpc: grpc.Server | None = field(default=None, init=False)
    _http: HttpReceiver | None = field(default=None, init=False)

    def start(self) -> Self:
        check_exposure(self.host, self.auth_token, self.insecure, self.tls is not None and self.tls.mutual)
        self.spool_dir = self.spool_dir or tempfile.mkdtemp(prefix="phaselens-spool-")
        self._spool = Spool(self.spool_dir, max_bytes=self.max_spool_bytes)
        ingest = Ingest(self._spool, self.metrics, self.max_body_bytes, self.auth_token)
        self._writer = SpoolWriter(
            self._spool,
            make_sink(self.clickhouse_url, self.database, self.cluster, self.cluster_insert, self.clickhouse_ca),
            self.metrics,
            self.batch_spans,
            self.flush_interval_s,
        )
        try:
            self._http = HttpReceiver(ingest, self.metrics_text, self.host, self.http_port, self.tls)
            self._grpc, self.grpc_port = start_grpc(ingest, self.host, self.grpc_port, tls=self.tls)
        except (OSError, ValueError):  # ValueError: TlsConfigError
            self.stop()
            raise
        self.http_port = self._http.port
        self._http.start()
        self._writer.start()
        return self

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"

    def metrics_text(self) -> str:
        return self.metrics.prometheus(self._spool.backlog_bytes if self._spool else 0)

    def stop(self, drain_timeout_s: float = 30.0) -> bool:
        """Stops receiving, then drains the spool into ClickHouse; True when all was written."""
        if self._grpc is not None:
            self._grpc.stop(grace=2).wait()
            self._grpc = None
        if self._http is not None:
            self._http.stop()
            self._http = None
        drained = True
        if self._writer is not None:
            drained = self._writer.stop(drain_timeout_s)
            self._writer = None
        if self._spool is not None:
            self._spool.close()
            self._spool = None
        return drained

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
