"""The collector as one object: per signal (traces, logs, metrics) a spool and its writer, and
the OTLP/gRPC + OTLP/HTTP receivers for all three; start/stop.

with Collector(clickhouse_url="http://127.0.0.1:8123", spool_dir="/tmp/spool") as c:
    ...  # export to c.grpc_endpoint (host:port) or c.http_endpoint + "/v1/traces" (/v1/logs, /v1/metrics)

Spools: the spans' in `spool_dir` itself, logs and metrics in its `logs/` and `metrics/`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Self

import grpc

from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.collectors.grpc_receiver import start_grpc
from phaselens.collectors.http_receiver import HttpReceiver
from phaselens.collectors.ingest import Ingest
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.collectors.shard_sink import ShardedSink, make_sink
from phaselens.collectors.signal_sink import SignalSink
from phaselens.collectors.signals import SIGNALS, TRACES, Signal
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
    batch_spans: int = 50_000  # per insert, of each signal's items (spans, log records, data points)
    flush_interval_s: float = 0.2
    metrics: CollectorMetrics = field(default_factory=CollectorMetrics)
    _spools: list[Spool] = field(default_factory=list, init=False)
    _writers: list[SpoolWriter] = field(default_factory=list, init=False)
    _grpc: grpc.Server | None = field(default=None, init=False)
    _http: HttpReceiver | None = field(default=None, init=False)

    def start(self) -> Self:
        check_exposure(self.host, self.auth_token, self.insecure, self.tls is not None and self.tls.mutual)
        self.spool_dir = self.spool_dir or tempfile.mkdtemp(prefix="phaselens-spool-")
        ingests = []
        try:
            for signal in SIGNALS:
                spool = Spool(os.path.join(self.spool_dir, signal.spool_subdir), max_bytes=self.max_spool_bytes)
                self._spools.append(spool)
                ingests.append(Ingest(spool, self.metrics, self.max_body_bytes, self.auth_token, signal))
                self._writers.append(
                    SpoolWriter(
                        spool, self._sink(signal), self.metrics, self.batch_spans, self.flush_interval_s, signal=signal
                    )
                )
            self._http = HttpReceiver(ingests, self.metrics_text, self.host, self.http_port, self.tls)
            self._grpc, self.grpc_port = start_grpc(ingests, self.host, self.grpc_port, tls=self.tls)
        except (OSError, ValueError):  # ValueError: TlsConfigError
            self.stop()
            raise
        self.http_port = self._http.port
        self._http.start()
        for writer in self._writers:
            writer.start()
        return self

    def _sink(self, signal: Signal) -> ClickHouseSink | ShardedSink | SignalSink:
        """Spans as `cluster_insert` says; logs and metrics one node, or a cluster's Distributed tables."""
        if signal is TRACES:
            return make_sink(self.clickhouse_url, self.database, self.cluster, self.cluster_insert, self.clickhouse_ca)
        return SignalSink(signal, ClickHouseSink(self.clickhouse_url, self.database, self.cluster, self.clickhouse_ca))

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"

    def metrics_text(self) -> str:
        return self.metrics.prometheus(sum(spool.backlog_bytes for spool in self._spools))

    def stop(self, drain_timeout_s: float = 30.0) -> bool:
        """Stops receiving, then drains the spools into ClickHouse; True when all was written."""
        if self._grpc is not None:
            self._grpc.stop(grace=2).wait()
            self._grpc = None
        if self._http is not None:
            self._http.stop()
            self._http = None
        # the writers drain side by side: each one's stop waits for its own thread only
        for writer in self._writers:
            writer.request_stop()
        stopped = [writer.stop(drain_timeout_s) for writer in self._writers]  # every one, even after a False
        drained = all(stopped)
        for spool in self._spools:
            spool.close()
        self._writers, self._spools = [], []
        return drained

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
